"""Two workers on one queue, one SIGKILLed mid-batch: the survivor finishes everything.

Both workers take jobs from the start; the killed one's `running` rows stop having their leases
renewed, and the survivor's reconciler re-sends them once the lease expires. Every job must end
exactly once, with the greedy output of a fault-free run, and the batch output must list each
job once.

A killed worker may also have received a message it had not claimed yet (the race is real: the
first run of this test lost a job that way for Redis' 10-minute visibility timeout). That case is
made certain here by a "thief" process (tests/reliability/message_thief.py) that takes one job's
message and is SIGKILLed before any worker starts; the job must still run exactly once. Either the
survivor's stranded-job sweep sends it again, or a message of the main batch claims its line first
(a batch message claims the model's fairest queued line, not one named line). Which one comes
first is timing; the sweep itself is proven where nothing else can claim the job
(tests/reliability/test_stranded_interactive.py, tests/worker/test_reconciler_stranded.py).

The victim stalls the jobs it runs (STALL_MARKER in conftest.py), so they are certainly still
running when it is killed, on any CPU; the survivor runs the same prompts at full speed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import redis
from sqlalchemy import func, select

from tests.reliability.conftest import (
    expected_tokens,
    job_lines,
    stalling,
    submit,
    wait_all_terminal,
    wait_until,
    worker_settings,
)
from tests.reliability.report import batch_output_duplicates, duplicates_of, report_row
from tests.services import REPO_ROOT, start_worker
from tests.worker.test_worker_e2e import _finalized_batch
from tokenloom.store.files.file_chunks import read_chunks
from tokenloom.store.models import Batch, BatchStatus, Job, JobStatus, utcnow
from tokenloom.worker.reconciler import EPOCH_KEY

MAX_NUM_SEQS = 3
NUM_JOBS = 10
NUM_LATE = 3  # submitted right after the kill
LEASE_S = 3


def _running_on(sessions, batch_id, worker_id: str) -> int:
    with sessions() as session:
        return session.execute(
            select(func.count())
            .select_from(Job)
            .where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING, Job.worker_id == worker_id)
        ).scalar_one()


def _taken_by(sessions, batch_id, worker_id: str) -> int:
    """Jobs of the batch the worker has claimed, running or already ended."""
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(Job).where(Job.batch_id == batch_id, Job.worker_id == worker_id)
        ).scalar_one()


def test_survivor_finishes_the_killed_workers_jobs(fault_checkpoint, pg_db, sessions, redis_server, tmp_path):
    lines = job_lines(NUM_JOBS, max_tokens=400, stalled=True)  # >= 20 s each on the victim
    late_lines = [{**line, "custom_id": f"late-{line['custom_id']}"} for line in job_lines(NUM_LATE, max_tokens=400)]
    settings = worker_settings(fault_checkpoint, pg_db, redis_server.url, MAX_NUM_SEQS, queue_lease_s=LEASE_S)
    stolen_line = {
        "custom_id": "stolen",
        "prompt": "a message taken by a worker that died",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    # Workers have used this Redis before (its epoch marker is set), so the "Redis lost its data"
    # sweep does not re-send queued jobs: only the stranded-job sweep can rescue the stolen one.
    redis.Redis.from_url(redis_server.url).set(EPOCH_KEY, "set-by-earlier-workers")
    thief = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.message_thief", redis_server.url, str(fault_checkpoint)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    stolen_batch = submit(sessions, redis_server.url, fault_checkpoint, [stolen_line], tmp_path)
    assert thief.stdout.readline().strip() == "took"
    thief.kill()
    thief.wait()
    stolen_at = utcnow()
    # Concurrency = batch size: with prefetch 1 (store/celery_app.py) a worker reserves only the
    # messages it claims at once, so the victim takes no unclaimed backlog down with it (that would
    # wait for Redis' 10-minute visibility timeout instead of the lease).
    victim = start_worker(stalling(settings), MAX_NUM_SEQS, tmp_path / "victim.log")
    survivor = start_worker(settings, MAX_NUM_SEQS, tmp_path / "survivor.log")
    try:
        victim.wait_ready()
        survivor.wait_ready()
        victim_id = f"{socket.gethostname()}:{victim.process.pid}"  # as worker/runtime.py names it
        survivor_id = f"{socket.gethostname()}:{survivor.process.pid}"
        batch_id = submit(sessions, redis_server.url, fault_checkpoint, lines, tmp_path)
        # Mid-batch: both workers took jobs, and the victim's are running (stalled: they cannot end).
        wait_until(
            lambda: _running_on(sessions, batch_id, victim_id) >= 1 and _taken_by(sessions, batch_id, survivor_id) >= 1,
            120,
            "both workers to take jobs",
        )
        victim.process.kill()
        victim.process.wait()
        killed_at = time.monotonic()
        orphaned = _running_on(sessions, batch_id, victim_id)
        stolen_orphaned = _running_on(sessions, stolen_batch, victim_id)  # the sweep may have handed it to the victim
        assert orphaned >= 1
        late_batch = submit(sessions, redis_server.url, fault_checkpoint, late_lines, tmp_path)  # during the fault
        # Recovery: every orphan has been taken over (claimed again or finished) by the survivor.
        wait_until(lambda: _running_on(sessions, batch_id, victim_id) == 0, 60, "orphans to be re-claimed")
        recovery_s = time.monotonic() - killed_at
        jobs = wait_all_terminal(sessions, batch_id, NUM_JOBS, timeout_s=180)
        finalized = _finalized_batch(sessions, batch_id)
        [stolen] = wait_all_terminal(sessions, stolen_batch, 1, timeout_s=60)
        late = wait_all_terminal(sessions, late_batch, len(late_lines), timeout_s=60)

    finally:
        survivor.stop()
        victim.stop()

    assert [j.status for j in jobs] == [JobStatus.SUCCEEDED] * NUM_JOBS, [j.error for j in jobs]
    expected = expected_tokens(fault_checkpoint, lines + late_lines + [stolen_line])
    assert {j.custom_id: j.output_token_ids for j in jobs + late} == {
        line["custom_id"]: expected[line["custom_id"]] for line in lines + late_lines
    }
    assert [j.status for j in late] == [JobStatus.SUCCEEDED] * NUM_LATE and {j.attempts for j in late} == {1}
    re_run = [j for j in jobs if j.attempts == 2]
    assert len(re_run) == orphaned and all(j.attempts in (1, 2) for j in jobs)
    assert all(j.worker_id.endswith(f":{survivor.process.pid}") for j in re_run)
    assert finalized == (BatchStatus.COMPLETED, NUM_JOBS, NUM_JOBS)
    with sessions() as session:
        output = b"".join(read_chunks(sessions, session.get(Batch, batch_id).output_file_id))
    custom_ids = [json.loads(line)["custom_id"] for line in output.splitlines()]
    assert sorted(custom_ids) == sorted(line["custom_id"] for line in lines)
    # The stolen job ran because the sweep re-sent it: once (the thief never claimed it), or twice
    # when the re-sent message reached the victim, which was running it when it was killed.
    assert stolen.status is JobStatus.SUCCEEDED and stolen.attempts == 1 + stolen_orphaned
    assert stolen.output_token_ids == expected["stolen"]
    re_sent_by_the_sweep = "were lost" in survivor.log() + victim.log()
    stolen_s = (stolen.finished_at - stolen_at).total_seconds()
    report_row(
        "worker died between receiving a message and claiming its job",
        1,
        1,
        0,
        0,
        stolen_s,
        "death -> job finished, instead of Redis' 10-min visibility timeout (includes starting the workers); "
        + ("re-sent by the stranded-job sweep" if re_sent_by_the_sweep else "claimed by a message of the main batch"),
    )
    report_row(
        f"2 workers, one SIGKILLed mid-batch ({orphaned} jobs orphaned, {NUM_LATE} submitted after the kill)",
        NUM_JOBS + NUM_LATE,
        len(jobs) + len(late),
        duplicates_of(custom_ids) + batch_output_duplicates(sessions, late_batch),
        NUM_JOBS + NUM_LATE - len({j.custom_id for j in jobs + late}),
        recovery_s,
        f"kill -> every orphan re-claimed by the survivor (lease {LEASE_S}s)",
    )
