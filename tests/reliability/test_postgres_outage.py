"""Postgres unreachable for a few seconds while a worker writes results: the results wait in the
worker and land once the database is back; no job is marked done without its row, none re-run.

The batch's jobs stall (STALL_MARKER in conftest.py: >= 5 s each, on any CPU), so when the database
is cut most of them are unfinished; it stays cut until a finished job's write has failed on it,
however long the engine takes to get there (its write retried a few times)."""

from __future__ import annotations

import re
import time

from sqlalchemy.engine import make_url

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
from tests.reliability.tcp_proxy import TcpProxy
from tests.services import start_worker
from tokenloom.store.models import JobStatus

MAX_NUM_SEQS = 4
NUM_JOBS = 12
NUM_DURING = 3  # submitted while the worker cannot reach the database: their claims wait for it
# store/db_retry.py's warning for a result write that failed and will be retried (attempt >= 3:
# the result has been held through several failed writes).
WRITE_RETRIED = re.compile(
    r"database unavailable while writing (a result|results) .*; retrying \(attempt ([3-9]|\d\d+)\)"
)


def test_results_land_after_a_postgres_outage(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    url = make_url(pg_db)
    proxy = TcpProxy(url.host, url.port or 5432)
    through_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    lines = job_lines(NUM_JOBS, max_tokens=100, stalled=True)
    settings = worker_settings(fault_checkpoint, through_proxy, redis_server.url, MAX_NUM_SEQS)
    worker = start_worker(stalling(settings), 2 * MAX_NUM_SEQS, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        wait_until(lambda: count_status(sessions, batch_id, JobStatus.SUCCEEDED) >= 1, 120, "a first result")
        proxy.cut()
        cut_at = time.monotonic()
        during = job_lines(NUM_DURING, max_tokens=200, prefix="during")
        during_id = submit(sessions, redis_server.url, fault_checkpoint, during, tmp_path)
        # Jobs keep finishing in the engine; their writes fail and retry. Cut until one has, repeatedly.
        wait_until(
            lambda: WRITE_RETRIED.search(worker.log()), 120, "a result write to fail and retry during the outage"
        )
        done_during_outage = count_status(sessions, batch_id, JobStatus.SUCCEEDED)
        proxy.restore()
        restored_at = time.monotonic()
        outage_s = restored_at - cut_at
        wait_until(
            lambda: count_status(sessions, batch_id, JobStatus.SUCCEEDED) > done_during_outage,
            60,
            "a result written after the outage",
        )
        recovery_s = time.monotonic() - restored_at
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
        during_jobs = wait_all_terminal(sessions, during_id, NUM_DURING, timeout_s=120)
    finally:
        worker.stop()
        proxy.close()
    assert done_during_outage < NUM_JOBS  # the outage really hit unfinished work
    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    assert {j.custom_id: j.output_token_ids for j in jobs} == expected_tokens(fault_checkpoint, lines)
    assert {j.attempts for j in jobs} == {1}  # results were kept and written, not recomputed
    assert [j.status for j in during_jobs] == [JobStatus.SUCCEEDED] * NUM_DURING
    assert {j.custom_id: j.output_token_ids for j in during_jobs} == expected_tokens(fault_checkpoint, during)
    assert {j.attempts for j in during_jobs} == {1}
    report_row(
        f"Postgres unreachable {outage_s:.0f}s while the worker writes results ({NUM_DURING} submitted during it)",
        NUM_JOBS + NUM_DURING,
        len(jobs) + len(during_jobs),
        batch_output_duplicates(sessions, batch_id) + batch_output_duplicates(sessions, during_id),
        NUM_JOBS + NUM_DURING - len(jobs) - len(during_jobs),
        recovery_s,
        "database back -> the next result is written",
    )
