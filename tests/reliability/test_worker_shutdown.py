"""SIGTERM: a worker drains for [queue] shutdown_timeout_s, then hands unfinished jobs back to the
queue; a second worker finishes everything. Real worker processes, Redis, Postgres, a tiny model.

The first worker stalls the jobs (engine/testing/fault_injection.py, see STALL_MARKER in conftest.py), so
they are certainly mid-generation when SIGTERM arrives and their length is known on any CPU: each
takes at least max_tokens * STALL_STEP_S. The second worker runs them at full speed.
"""

from __future__ import annotations

import signal
import time

from tests.reliability.conftest import (
    count_status,
    expected_tokens,
    job_lines,
    running_with_tokens,
    stalling,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.reliability.report import batch_output_duplicates, report_row
from tests.services import start_worker
from tokenloom.engine.testing.fault_injection import STALL_STEP_S
from tokenloom.store.models import JobStatus

MAX_NUM_SEQS = 4
NUM_JOBS = 8


def _sigterm_then_finish_elsewhere(
    fault_checkpoint,
    pg_db,
    sessions,
    redis_server,
    tmp_path,
    *,
    max_tokens: int,
    shutdown_timeout_s: float,
    exit_within_s: float,
):
    lines = job_lines(NUM_JOBS, max_tokens, stalled=True)
    settings = worker_settings(
        fault_checkpoint,
        pg_db,
        redis_server.url,
        MAX_NUM_SEQS,
        queue_lease_s=6,
        queue_shutdown_timeout_s=shutdown_timeout_s,
    )
    first = start_worker(stalling(settings), 2 * MAX_NUM_SEQS, tmp_path / "first.log")
    first.wait_ready()
    batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
    # Mid-generation: a full engine's worth of jobs running, each with tokens out (none can end yet).
    wait_until(
        lambda: running_with_tokens(sessions, batch_id, redis_server.url) >= MAX_NUM_SEQS,
        120,
        "jobs to run and stream tokens",
    )
    running_at_sigterm = count_status(sessions, batch_id, JobStatus.RUNNING)
    signalled = time.monotonic()
    first.process.send_signal(signal.SIGTERM)
    first.process.wait(exit_within_s)
    exit_s = time.monotonic() - signalled
    # Nothing is left claimed by the stopped worker: each job is done or back in the queue.
    assert count_status(sessions, batch_id, JobStatus.RUNNING, JobStatus.CANCELLING) == 0, first.log()[-3000:]
    assert running_at_sigterm >= MAX_NUM_SEQS

    second = start_worker(settings, 2 * MAX_NUM_SEQS, tmp_path / "second.log")  # no stall: full speed
    try:
        second.wait_ready()
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
    finally:
        second.stop()
    expected = expected_tokens(fault_checkpoint, lines)
    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected
    assert {j.attempts for j in jobs} == {1}  # a graceful hand-back is not a failed attempt
    report_row(
        f"worker SIGTERM mid-batch, shutdown_timeout_s={shutdown_timeout_s:g}",
        NUM_JOBS,
        len(jobs),
        batch_output_duplicates(sessions, batch_id),
        NUM_JOBS - len(jobs),
        exit_s,
        "SIGTERM -> worker exited with nothing left running (drained or handed back)",
    )
    return jobs, first, running_at_sigterm, exit_s


def test_sigterm_lets_running_jobs_finish_within_the_timeout(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    # 8 jobs of >= 5 s each, two rounds on 4 engine slots: ~10 s of work, well inside the 120 s window.
    jobs, first, running, _ = _sigterm_then_finish_elsewhere(
        fault_checkpoint,
        pg_db,
        sessions,
        redis_server,
        tmp_path,
        max_tokens=100,
        shutdown_timeout_s=120,
        exit_within_s=150,
    )
    finished_by_first = [j for j in jobs if j.worker_id.endswith(f":{first.process.pid}")]
    assert len(finished_by_first) >= running  # drained: every job running at SIGTERM finished there
    assert "handed back to the queue" not in first.log()


def test_sigterm_hands_unfinished_jobs_back_after_the_timeout(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path
):
    shutdown_timeout_s, max_tokens = 1.0, 800
    job_floor_s = max_tokens * STALL_STEP_S  # 40 s: no job can end inside the 1 s window
    jobs, first, running, exit_s = _sigterm_then_finish_elsewhere(
        fault_checkpoint,
        pg_db,
        sessions,
        redis_server,
        tmp_path,
        max_tokens=max_tokens,
        shutdown_timeout_s=shutdown_timeout_s,
        exit_within_s=job_floor_s,
    )
    # It stopped at the deadline instead of waiting for its jobs (those needed >= job_floor_s).
    assert exit_s < job_floor_s, f"worker took {exit_s:.1f}s to stop"
    handed_back = first.log().count("handed back to the queue")
    finished_by_first = sum(j.worker_id.endswith(f":{first.process.pid}") for j in jobs)
    # Every job claimed at SIGTERM (the engine's running ones and the prefetched ones waiting for a
    # slot) was handed back: none could finish inside the window. The second worker finished them.
    assert finished_by_first == 0, first.log()[-3000:]
    assert handed_back >= running >= MAX_NUM_SEQS, first.log()[-3000:]
