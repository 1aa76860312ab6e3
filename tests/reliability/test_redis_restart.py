"""Redis restarted (no persistence) while jobs are queued and running: the worker reconnects by
itself, the reconciler re-sends the queued jobs whose messages Redis lost, and all finish once.

The jobs stall (STALL_MARKER in conftest.py: >= 5 s each, on any CPU), so when Redis goes down the
first ones are still running and the rest still queued; each step waits on a state, not a pause."""

from __future__ import annotations

import time

import redis

from tests.reliability.conftest import (
    count_status,
    expected_tokens,
    job_lines,
    stalling,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.reliability.report import batch_output_duplicates, report_row
from tests.services import start_worker
from tokenloom.store.models import JobStatus
from tokenloom.worker.reconciler import EPOCH_KEY

MAX_NUM_SEQS = 4
NUM_JOBS = 12


def test_redis_restart_while_jobs_are_queued_and_running(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    lines = job_lines(NUM_JOBS, max_tokens=100, stalled=True)
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=3)
    worker = start_worker(stalling(settings), MAX_NUM_SEQS, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        # The first heartbeat marks this Redis's epoch: after the restart, a missing one then means the loss.
        epoch = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: epoch.exists(EPOCH_KEY), 60, "the worker to mark the Redis epoch")
        epoch.close()
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        wait_until(lambda: count_status(sessions, batch_id, JobStatus.RUNNING) >= MAX_NUM_SEQS, 120, "jobs to run")
        queued_at_restart = count_status(sessions, batch_id, JobStatus.QUEUED)
        assert queued_at_restart > 0  # some jobs lived only in Redis when it went down
        failed_beats = worker.log().count("heartbeat failed")
        redis_server.stop()
        # Down until the worker has noticed (a heartbeat failed on it), however fast that is.
        wait_until(lambda: worker.log().count("heartbeat failed") > failed_beats, 60, "the worker to see Redis down")
        redis_server.start()  # empty: every queued message is gone
        restarted_at = time.monotonic()
        # Recovery: a job that lived only in the lost Redis is claimed again.
        wait_until(
            lambda: count_status(sessions, batch_id, JobStatus.QUEUED) < queued_at_restart,
            60,
            "a lost job to be re-sent and claimed",
        )
        recovery_s = time.monotonic() - restarted_at
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
    finally:
        worker.stop()
    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected_tokens(fault_checkpoint, lines)
    assert {j.attempts for j in jobs} == {1}
    assert "queued jobs so none is lost" in worker.log()  # the reconciler made up for the loss
    report_row(
        f"Redis restarted without persistence ({queued_at_restart} jobs queued only in Redis)",
        NUM_JOBS,
        len(jobs),
        batch_output_duplicates(sessions, batch_id),
        NUM_JOBS - len(jobs),
        recovery_s,
        "Redis back -> a job it lost is claimed again",
    )
