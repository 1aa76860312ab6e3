"""A venv that sees the packages of the environment running the tests (a virtualenv or not) after
its own: for tests that install something on top of the locked set (a wheel, a client library)
without touching the environment under test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def see_this_environments_packages(python: Path) -> None:
    """Put this interpreter's site-packages after the venv's own, as plain path entries: their .pth
    files are not run, so the checkout's editable tokenloom stays invisible to the venv."""
    venv_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (Path(venv_site) / "tested-environment.pth").write_text("".join(f"{p}\n" for p in ours))
