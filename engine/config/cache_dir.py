"""Where tokenloom keeps what it builds or converts once per machine (demo models, GGUF conversions)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    # Read here, not at the config edge: XDG_CACHE_HOME is the desktop convention every tool follows.
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenloom"
