"""engine/cpu/malloc.py: with the engine's malloc thresholds a step-sized tensor comes from the heap
(reused next step) instead of fresh mmap'd pages (faulted in again every step). Each case runs in
a fresh interpreter: the thresholds are process-wide and glibc moves its defaults as it goes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import ctypes, sys
import torch
from tokenloom.engine.cpu.malloc import keep_step_buffers_in_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert keep_step_buffers_in_heap()
before = libc.mallinfo2().hblkhd  # bytes in mmap'd chunks
step_tensor = torch.empty(20 << 20, dtype=torch.uint8)  # the size of a large step's logits
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_bytes_for_a_20mb_tensor(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip().splitlines()[-1])


def test_step_sized_tensors_come_from_the_heap_with_the_engine_thresholds():
    assert _mmapped_bytes_for_a_20mb_tensor("default") >= 20 << 20  # glibc's default: fresh pages
    assert _mmapped_bytes_for_a_20mb_tensor("tuned") == 0
