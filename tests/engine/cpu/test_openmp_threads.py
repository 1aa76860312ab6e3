"""Work tokenloom does before its engine thread starts leaves no OpenMP team on the caller's thread
(engine/cpu/openmp_threads.py: a team left on a long-lived thread made every decode step take ~1.5x as long)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tokenloom.engine.cpu.openmp_threads import in_passing_thread

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

# A fresh interpreter (the test process's own threads may hold teams already): the thread count
# of the process before and after, with torch running 2 intra-op threads even on a 1-core machine.
# A thread that has exited, and its team's workers, leave /proc a moment after join() returns:
# the count is polled for up to SETTLE_S (the first test's control case waits that long).
THREADS_LEFT_BEHIND = textwrap.dedent("""
    import os, time, torch
    torch.set_num_threads(2)
    threads = lambda: len(os.listdir("/proc/self/task"))
    before = threads()
    {call}
    deadline = time.monotonic() + {settle_s}
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    print(threads() - before)
""")
SETTLE_S = 3.0


def _threads_left_behind(call: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", THREADS_LEFT_BEHIND.format(call=call, settle_s=SETTLE_S)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_a_parallel_op_on_the_callers_thread_leaves_a_team_but_not_through_a_passing_thread():
    # The premise, so the second assertion cannot pass vacuously: a GEMM on this thread leaves a worker.
    assert _threads_left_behind("torch.randn(512, 512) @ torch.randn(512, 512)") >= 1
    call = (
        "from tokenloom.engine.cpu.openmp_threads import in_passing_thread\n"
        "in_passing_thread(lambda: torch.randn(512, 512) @ torch.randn(512, 512))"
    )
    assert _threads_left_behind(call) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_the_dtype_probe_leaves_no_team_on_the_callers_thread():
    assert (
        _threads_left_behind(
            "from tokenloom.engine.runner.device import cpu_bfloat16_is_faster\ncpu_bfloat16_is_faster()"
        )
        == 0
    )


def test_results_and_exceptions_come_back_from_the_passing_thread():
    assert in_passing_thread(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        in_passing_thread(lambda: 1 / 0)
