"""A worker killed with SIGKILL mid-batch, then a new one started: every job ends exactly once.

The killed worker's jobs keep `running` rows whose leases stop being renewed; the new worker's
reconciler re-sends them once the lease expires, and the claim counts the attempt. The first worker
stalls the jobs (STALL_MARKER in conftest.py), so they are certainly running when it is killed, on
any CPU; the new worker runs them at full speed.
"""

from __future__ import annotations

import json
import socket
import time

from tests.reliability.conftest import (
    count_status,
    expected_tokens,
    job_lines,
    jobs_of,
    running_with_tokens,
    stalling,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.reliability.report import batch_output_duplicates, report_row
from tests.services import start_worker
from tests.worker.test_worker_e2e import _finalized_batch
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.models import Batch, BatchStatus, JobStatus

MAX_NUM_SEQS = 4
NUM_JOBS = 10
NUM_DURING = 3  # submitted while no worker is alive
LEASE_S = 4


def test_sigkill_mid_batch_then_restart_loses_and_duplicates_nothing(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path
):
    lines = job_lines(NUM_JOBS, max_tokens=600, stalled=True)  # >= 30 s each on the first worker
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=LEASE_S)
    first = start_worker(stalling(settings), 2 * MAX_NUM_SEQS, tmp_path / "first.log")
    first.wait_ready()
    batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
    wait_until(
        lambda: running_with_tokens(sessions, batch_id, redis_server.url) >= MAX_NUM_SEQS,
        120,
        "jobs to run and stream tokens",
    )
    first.process.kill()
    first.process.wait()
    killed_at = time.monotonic()
    first_id = f"{socket.gethostname()}:{first.process.pid}"
    orphaned = count_status(sessions, batch_id, JobStatus.RUNNING)
    assert orphaned >= MAX_NUM_SEQS
    during = job_lines(NUM_DURING, max_tokens=200, prefix="during")
    during_id = submit(sessions, redis_server.url, fault_checkpoint, during, tmp_path)

    second = start_worker(settings, 2 * MAX_NUM_SEQS, tmp_path / "second.log")
    try:
        second.wait_ready()
        wait_until(
            lambda: (
                not [
                    j for j in jobs_of(sessions, batch_id) if j.status is JobStatus.RUNNING and j.worker_id == first_id
                ]
            ),
            60,
            "orphans re-claimed",
        )
        recovery_s = time.monotonic() - killed_at
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
        during_jobs = wait_all_terminal(sessions, during_id, NUM_DURING, timeout_s=120)
        status, completed, output_lines = _finalized_batch(sessions, batch_id)
    finally:
        second.stop()

    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected_tokens(fault_checkpoint, lines)
    # The orphans were re-run once each (attempt 2); the rest ran once.
    assert sorted(j.attempts for j in jobs) == [1] * (NUM_JOBS - orphaned) + [2] * orphaned
    assert second.log().count("its worker stopped renewing the lease") >= orphaned
    # The batch output file has one line per job: none lost, none duplicated.
    assert (status, completed, output_lines) == (BatchStatus.COMPLETED, NUM_JOBS, NUM_JOBS)
    with sessions() as session:
        output = b"".join(read_chunks(sessions, session.get(Batch, batch_id).output_file_id))
    custom_ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert sorted(custom_ids) == sorted(line["custom_id"] for line in lines)
    # Jobs submitted while no worker ran waited in the queue and ran once on the new worker.
    assert [j.status for j in during_jobs] == [JobStatus.SUCCEEDED] * NUM_DURING
    assert {j.custom_id: j.output_token_ids for j in during_jobs} == expected_tokens(fault_checkpoint, during)
    assert {j.attempts for j in during_jobs} == {1}
    report_row(
        f"worker SIGKILLed mid-batch, new worker started ({orphaned} jobs orphaned, {NUM_DURING} submitted while down)",
        NUM_JOBS + NUM_DURING,
        len(jobs) + len(during_jobs),
        batch_output_duplicates(sessions, batch_id) + batch_output_duplicates(sessions, during_id),
        NUM_JOBS + NUM_DURING - len(jobs) - len(during_jobs),
        recovery_s,
        f"kill -> new worker up and every orphan re-claimed (lease {LEASE_S}s)",
    )
