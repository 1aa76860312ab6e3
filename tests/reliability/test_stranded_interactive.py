"""Chat requests of a dead worker while a batch backlog waits (issue 43): they finish within a minute,
exactly once, instead of waiting out Redis' 10-minute visibility timeout.

Two ways a worker dies holding interactive work, both here, with a batch's messages waiting on the
model's queue the whole time:
- it received their messages but died before claiming the rows: a "thief" process
  (tests/reliability/message_thief.py) takes the interactive messages and is SIGKILLed. The rows stay
  `queued` with no message; the stranded-job sweep must send them again although the model's queue
  is not empty (it holds the batch's messages): it looks at each class's queue on its own;
- it claimed them and runs them: a real worker is SIGKILLed; the leases expire and the next worker
  runs them again, whatever batch lines the dead worker also held.

Both workers stall the batch's lines (STALL_MARKER), so the backlog lasts minutes on any CPU; the
chats carry no marker, and run in the stalled steps at one token per STALL_STEP_S.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import redis

from tests.reliability.conftest import (
    count_status,
    expected_tokens,
    job_lines,
    stalling,
    submit,
    wait_until,
    worker_settings,
)
from tests.reliability.report import report_row
from tests.reliability.test_work_classes import _interactive_jobs, _rows
from tests.services import REPO_ROOT, start_worker
from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import JobStatus
from tokenloom.worker.reconciler import EPOCH_KEY

MAX_NUM_SEQS = 4
CLAIM_THREADS = 4
LEASE_S = 3  # stranded after 2 x lease_s = 6 s; leases expire 3 s after a worker's death
NUM_LINES = 60  # 15 messages of 4 lines: most wait on the model's queue the whole test
NUM_STOLEN = 2
NUM_HELD = 3
CHAT_TOKENS = 100  # >= 5 s in stalled steps: the held chats are still running when their worker dies
WITHIN_S = 60


def _batch_messages_waiting(client: redis.Redis, model: str) -> int:
    return sum(client.llen(key) for key in class_queue_keys(model)[WorkClass.BATCH])


def test_a_dead_workers_chats_finish_within_a_minute_behind_a_batch_backlog(
    fault_checkpoint, pg_db, sessions, redis_server, tmp_path
):
    model = str(fault_checkpoint)
    client = redis.Redis.from_url(redis_server.url)
    # Workers have used this Redis before (its epoch marker is set), so the "Redis lost its data"
    # sweep sends nothing: only the stranded-job sweep can rescue the stolen chats.
    client.set(EPOCH_KEY, "set-by-earlier-workers")
    settings = stalling(
        worker_settings(
            fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=LEASE_S, queue_shutdown_timeout_s=0
        )
    )
    stolen_prompts = [f"stolen chat {i}: the queue keeps every request" for i in range(NUM_STOLEN)]
    held_prompts = [f"held chat {i}: the queue keeps every request" for i in range(NUM_HELD)]
    batch_id = submit(sessions, redis_server.url, fault_checkpoint, job_lines(NUM_LINES, 400, stalled=True), tmp_path)

    thief = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.reliability.message_thief",
            redis_server.url,
            model,
            "interactive",
            str(NUM_STOLEN),
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stolen = _interactive_jobs(sessions, redis_server.url, model, stolen_prompts, CHAT_TOKENS)
        assert thief.stdout is not None and thief.stdout.readline().strip() == "took"
    finally:
        thief.kill()
        thief.wait()

    victim = start_worker(settings, CLAIM_THREADS, tmp_path / "victim.log")
    survivor = None
    try:
        victim.wait_ready()
        victim_id = f"{socket.gethostname()}:{victim.process.pid}"  # as worker/runtime.py names it
        wait_until(
            lambda: count_status(sessions, batch_id, JobStatus.RUNNING) >= 2 * MAX_NUM_SEQS,
            120,
            "the victim to hold a full claim window of batch lines",
        )
        held = _interactive_jobs(sessions, redis_server.url, model, held_prompts, CHAT_TOKENS)
        wait_until(
            lambda: all(j.status is JobStatus.RUNNING and j.worker_id == victim_id for j in _rows(sessions, held)),
            60,
            "the victim to run the held chats",
        )
        victim.process.kill()
        victim.process.wait()
        killed_at = time.monotonic()
        at_kill = {job.id: (job.status, job.worker_id) for job in _rows(sessions, stolen + held)}
        assert _batch_messages_waiting(client, model) > 0  # the backlog waits on the model's queue

        survivor = start_worker(settings, CLAIM_THREADS, tmp_path / "survivor.log")
        survivor.wait_ready()
        wait_until(
            lambda: all(j.status is JobStatus.SUCCEEDED for j in _rows(sessions, stolen + held)),
            WITHIN_S,
            "every chat to finish",
        )
        finished_s = time.monotonic() - killed_at
        backlog_after = _batch_messages_waiting(client, model)
        logs = victim.log() + survivor.log()
    finally:
        if survivor is not None:
            survivor.stop()
        victim.stop()
        client.close()

    assert finished_s < WITHIN_S  # kill -> every chat finished, the new worker's start included
    assert backlog_after > 0, "the batch backlog drained: the test no longer shows the sweep ignores it"
    # The stolen chats' messages were re-sent by the stranded-job sweep (by the victim, or the survivor).
    assert "interactive job(s)" in logs and "were lost" in logs
    # Exactly once: one result each, the greedy tokens of an undisturbed run, and one claim per
    # worker that ran it (a second only where the victim was running it when it died).
    expected = expected_tokens(
        fault_checkpoint,
        [
            {"custom_id": str(job_id), "prompt": prompt, "max_tokens": CHAT_TOKENS}
            for job_id, prompt in zip(stolen + held, stolen_prompts + held_prompts)
        ],
    )
    for job in _rows(sessions, stolen + held):
        status, worker_id = at_kill[job.id]
        orphaned = status is JobStatus.RUNNING and worker_id == victim_id
        assert job.status is JobStatus.SUCCEEDED and job.output_token_ids == expected[str(job.id)], job.error
        assert job.attempts == (2 if orphaned else 1), (job.id, job.attempts, status, worker_id)
    assert all(at_kill[job_id] == (JobStatus.RUNNING, victim_id) for job_id in held)
    report_row(
        f"worker SIGKILLed holding chat requests ({NUM_HELD} claimed, {NUM_STOLEN} received and not claimed) "
        f"behind a {NUM_LINES}-line batch backlog",
        NUM_STOLEN + NUM_HELD,
        NUM_STOLEN + NUM_HELD,
        0,
        0,
        finished_s,
        f"kill -> every chat finished, the new worker's start included (lease {LEASE_S}s)",
    )
