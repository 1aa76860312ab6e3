"""Two workers on one model's queue share a batch sent in groups, and no job is claimed twice.

Each worker has one claim thread and an engine of two sequences, so it holds at most four
claimed jobs and one message it cannot claim yet: the rest of the batch stays on Redis for the
other worker. The jobs stall (STALL_MARKER), so neither worker can finish the batch alone before
the other has taken its share, on any CPU.
"""

from __future__ import annotations

import socket

from tests.reliability.conftest import (
    GROUP_SIZE,
    expected_tokens,
    job_lines,
    stalling,
    submit,
    wait_all_terminal,
    worker_settings,
)
from tests.services import start_worker
from tests.worker.test_worker_e2e import _finalized_batch
from tokenloom.store.models import BatchStatus, JobStatus

MAX_NUM_SEQS = 2
NUM_JOBS = 6 * GROUP_SIZE


def test_two_workers_share_a_batch_without_double_claims(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    lines = job_lines(NUM_JOBS, max_tokens=24, stalled=True)  # >= 1.2 s each
    settings = stalling(worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS))
    first = start_worker(settings, 1, tmp_path / "first.log")
    second = start_worker(settings, 1, tmp_path / "second.log")
    try:
        first.wait_ready()
        second.wait_ready()
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=300)
        finalized = _finalized_batch(sessions, batch_id)
    finally:
        first.stop()
        second.stop()

    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.attempts for j in jobs} == {1}  # claimed once each: no job ran on both workers
    worker_ids = {f"{socket.gethostname()}:{w.process.pid}" for w in (first, second)}
    ran_on = {worker_id: sum(j.worker_id == worker_id for j in jobs) for worker_id in worker_ids}
    assert sum(ran_on.values()) == NUM_JOBS
    assert all(n >= MAX_NUM_SEQS for n in ran_on.values()), ran_on  # both took a real share
    expected = expected_tokens(fault_checkpoint, lines)
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected
    assert finalized == (BatchStatus.COMPLETED, NUM_JOBS, NUM_JOBS)
