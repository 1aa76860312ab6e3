"""A checkpoint directory built once in a shared cache, however many processes start together.

The API and every worker of `docker compose up` share one models volume and start at the same
moment, each in its own container where its pid is often the same (1). So the builder takes a
file lock beside the target (flock works across containers on one host's volume), checks again
under it, builds into a staging folder no other process can name, and renames that into place:
the others wait on the lock and then reuse the finished checkpoint, and no process ever reads or
deletes another's half-written files.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("tokenloom.engine")

# How long a process waits for another's build before saying so in the log (then it waits on).
WAIT_NOTICE_S = 5.0


def is_built(target: Path) -> bool:
    """A checkpoint directory is complete once its config.json is there (renamed in last, with the rest)."""
    return (target / "config.json").is_file()


def build_once(target: Path, build: Callable[[Path], object], what: str) -> Path:
    """`target`, built by `build(staging_dir)` unless it is already complete; `what` names it in the log."""
    target = Path(target)
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.parent / f".{target.name}.lock")
    try:
        lock.acquire(timeout=WAIT_NOTICE_S)
    except Timeout:
        log.info("waiting for another process that is building %s into %s", what, target)
        lock.acquire()
    try:
        if is_built(target):  # built by the process that held the lock before us
            return target
        for stale in target.parent.glob(f".{target.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a killed build's: under the lock no other is running
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
        try:
            build(staging)
            if target.is_dir():
                shutil.rmtree(target)  # left incomplete by a build that was killed before its rename
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        lock.release()
    return target
