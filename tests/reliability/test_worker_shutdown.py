"""SIGTERM: a worker drains for [queue] shutdown_timeout_s, then hands unfinished jobs back to the
queue; a second worker finishes everything. Real worker processes, Redis, Postgres, a tiny model."""

from __future__ import annotations

import signal
import time

from tests.reliability.conftest import (
    count_status, expected_tokens, job_lines, submit, wait_all_terminal, wait_until, worker_settings,
)
from tests.reliability.report import batch_output_duplicates, report_row
from tests.worker.conftest import start_worker
from worker.models import JobStatus

MAX_NUM_SEQS = 4
NUM_JOBS = 8


def _sigterm_then_finish_elsewhere(fault_checkpoint, pg_db, sessions, redis_server, tmp_path, *,
                                   max_tokens: int, shutdown_timeout_s: float):
    lines = job_lines(NUM_JOBS, max_tokens)
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS,
                               queue_lease_s=6, queue_shutdown_timeout_s=shutdown_timeout_s)
    first = start_worker(settings, 2 * MAX_NUM_SEQS, tmp_path / "first.log")
    first.wait_ready()
    batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
    wait_until(lambda: count_status(sessions, batch_id, JobStatus.RUNNING) >= MAX_NUM_SEQS, 60, "jobs to run")
    time.sleep(0.5)  # mid-generation
    running_at_sigterm = count_status(sessions, batch_id, JobStatus.RUNNING)
    signalled = time.monotonic()
    first.process.send_signal(signal.SIGTERM)
    first.process.wait(shutdown_timeout_s + 30)
    exit_s = time.monotonic() - signalled
    # Nothing is left claimed by the stopped worker: each job is done or back in the queue.
    assert count_status(sessions, batch_id, JobStatus.RUNNING, JobStatus.CANCELLING) == 0, first.log()[-3000:]

    second = start_worker(settings, 2 * MAX_NUM_SEQS, tmp_path / "second.log")
    try:
        second.wait_ready()
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
    finally:
        second.stop()
    expected = expected_tokens(fault_checkpoint, lines)
    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected
    assert {j.attempts for j in jobs} == {1}  # a graceful hand-back is not a failed attempt
    report_row(f"worker SIGTERM mid-batch, shutdown_timeout_s={shutdown_timeout_s:g}", NUM_JOBS, len(jobs),
               batch_output_duplicates(sessions, batch_id), NUM_JOBS - len(jobs), exit_s,
               "SIGTERM -> worker exited with nothing left running (drained or handed back)")
    return jobs, first, running_at_sigterm, exit_s


def test_sigterm_lets_running_jobs_finish_within_the_timeout(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    jobs, first, running, _ = _sigterm_then_finish_elsewhere(
        fault_checkpoint, pg_db, sessions, redis_server, tmp_path, max_tokens=300, shutdown_timeout_s=120)
    finished_by_first = [j for j in jobs if j.worker_id.endswith(f":{first.process.pid}")]
    assert len(finished_by_first) >= running  # drained: every job running at SIGTERM finished there
    assert "handed back to the queue" not in first.log()


def test_sigterm_hands_unfinished_jobs_back_after_the_timeout(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    shutdown_timeout_s = 1.0
    jobs, first, running, exit_s = _sigterm_then_finish_elsewhere(
        fault_checkpoint, pg_db, sessions, redis_server, tmp_path, max_tokens=1900,
        shutdown_timeout_s=shutdown_timeout_s)
    assert exit_s < shutdown_timeout_s + 15, f"worker took {exit_s:.1f}s to stop"
    handed_back = first.log().count("handed back to the queue")
    finished_by_first = sum(j.worker_id.endswith(f":{first.process.pid}") for j in jobs)
    # Every job claimed at SIGTERM (the engine's running ones and the prefetched ones waiting for a
    # slot) either finished inside the drain window or was handed back. The window is far too short
    # for 1900 tokens, so at the deadline a full engine's worth of jobs was still running.
    assert running >= MAX_NUM_SEQS
    assert handed_back + finished_by_first >= running, first.log()[-3000:]
    assert handed_back >= MAX_NUM_SEQS, first.log()[-3000:]
    # The jobs it handed back were finished by the second worker.
    assert len(jobs) - finished_by_first >= handed_back
