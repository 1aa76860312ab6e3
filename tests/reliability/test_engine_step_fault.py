"""An exception inside an engine step, in a real worker process: the job it hits fails with the
reason recorded, the jobs batched with it and after it succeed with fault-free outputs, and the
batch still finalizes with one output or error line per job.

The fault is the engine's test hook (engine/testing/fault_injection.py), armed for the worker process by
TOKENLOOM_FAULT_INJECT_PROMPT: the forward pass raises for a prompt holding the marker. The same
variable stalls the first batch's clean jobs (STALL_MARKER in conftest.py: >= 5 s each, on any CPU),
so they are certainly still decoding when the poisoned job joins them in a step.
"""

from __future__ import annotations

import json
import time

from tests.reliability.conftest import (
    STALL_MARKER,
    expected_tokens,
    job_lines,
    running_with_tokens,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.reliability.report import duplicates_of, report_row
from tests.services import start_worker
from tests.worker.test_worker_e2e import _finalized_batch
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.models import Batch, BatchStatus, JobErrorCode, JobStatus

MAX_NUM_SEQS = 4
NUM_CLEAN = 6
MARKER = "ENGINE-FAULT-MARKER"


def test_engine_step_fault_fails_only_its_job(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    clean = job_lines(NUM_CLEAN, max_tokens=100, stalled=True)
    poisoned, after = job_lines(NUM_CLEAN + 2, max_tokens=100)[NUM_CLEAN:]
    poisoned["prompt"] = f"{MARKER} {poisoned['prompt']}"
    lines = clean + [poisoned, after]
    settings = worker_settings(
        fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, fault_inject_prompt=f"{MARKER};stall:{STALL_MARKER}"
    )
    worker = start_worker(settings, 2 * MAX_NUM_SEQS, tmp_path / "worker.log")
    try:
        worker.wait_ready()
        submitted = time.monotonic()
        first = submit(sessions, redis_server.url, fault_checkpoint, clean, tmp_path)
        # The poisoned job arrives while others decode (stalled: they cannot have ended), so its
        # failing step is a shared one.
        wait_until(lambda: running_with_tokens(sessions, first, redis_server.url) >= 2, 120, "jobs to decode")
        second = submit(sessions, redis_server.url, fault_checkpoint, [poisoned, after], tmp_path)
        jobs = wait_all_terminal(sessions, first, NUM_CLEAN, 120) + wait_all_terminal(sessions, second, 2, 120)
        elapsed = time.monotonic() - submitted
        finalized = [_finalized_batch(sessions, first), _finalized_batch(sessions, second)]
        assert worker.process.poll() is None  # the worker survived the fault
    finally:
        worker.stop()

    bad = jobs[NUM_CLEAN]
    assert bad.custom_id == poisoned["custom_id"] and bad.status is JobStatus.FAILED
    assert bad.error.startswith("engine error: ") and "injected fault" in bad.error and MARKER in bad.error
    assert bad.error_code is JobErrorCode.ENGINE_ERROR
    good = [j for j in jobs if j is not bad]
    assert [j.status for j in good] == [JobStatus.SUCCEEDED] * (NUM_CLEAN + 1), [j.error for j in good]
    assert {j.custom_id: j.output_token_ids for j in good} == expected_tokens(fault_checkpoint, clean + [after])
    assert {j.attempts for j in jobs} == {1}  # a failed job is recorded once, not retried into a loop
    # Each batch ends with one line per job; the poisoned one is the error file's only line.
    assert finalized == [(BatchStatus.COMPLETED, NUM_CLEAN, NUM_CLEAN), (BatchStatus.COMPLETED, 1, 1)]
    with sessions() as session:
        output_ids, errors = [], []
        for batch_id in (first, second):
            batch = session.get(Batch, batch_id)
            output_ids += [
                json.loads(x)["custom_id"] for x in b"".join(read_chunks(sessions, batch.output_file_id)).splitlines()
            ]
            if batch.error_file_id:
                errors += [json.loads(x) for x in b"".join(read_chunks(sessions, batch.error_file_id)).splitlines()]
    assert [e["custom_id"] for e in errors] == [poisoned["custom_id"]]
    assert "injected fault" in json.dumps(errors[0])
    assert "re-running each chunk alone" in worker.log()  # the shared step was retried, not failed whole
    report_row(
        "engine exception inside a step (1 poisoned job)",
        len(lines),
        len(jobs),
        duplicates_of(output_ids + [e["custom_id"] for e in errors]),
        len(lines) - len(jobs),
        None,
        f"no outage: the worker kept serving; all jobs ended {elapsed:.1f}s after submission",
    )
