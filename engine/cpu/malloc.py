"""glibc malloc settings for a CPU engine: keep step-sized tensors in the heap between steps.

Every step allocates and frees tensors of 0.1-12 MB (activations, the float32 logits). glibc
serves a request above its mmap threshold (128 KiB at start, then moved by what was last freed)
with fresh pages from the OS, and hands the top of the heap back once more than its trim
threshold is free; either way the next step faults the same memory in again, a few microseconds
per 4 KiB page. On W1 (bench/offline.py) a run took 0.45-1.44 M minor page faults, the worst
runs the slowest; with these settings 0.43 M, every run.

Fixed thresholds instead: requests up to 32 MiB (glibc's ceiling for the mmap threshold) come
from the heap, and up to 1 GiB of freed heap stays mapped for the next step. The cost is that
the process keeps its peak step memory mapped, which a long-running engine needs again anyway.
Only glibc has mallopt; elsewhere (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("tokenloom.engine")

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc: mallopt refuses more
TRIM_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


def keep_step_buffers_in_heap() -> bool:
    """Apply the thresholds once per process; True when glibc accepted them."""
    global _applied
    if _applied is None:
        _applied = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        if not _applied:
            log.debug("malloc thresholds unchanged (not glibc, or mallopt refused them)")
    return _applied


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library handle, or a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1
