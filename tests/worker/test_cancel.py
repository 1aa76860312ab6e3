"""Cancelling jobs and batches: store transitions on a real Postgres, then a real worker process
(Redis broker, Postgres rows, a tiny real model) driven by `tokenloom submit` / `tokenloom cancel`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import select, update

from tests.services import REPO_ROOT as ROOT
from tests.services import running_worker
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.testing.fault_injection import STALL_STEP_S
from tokenloom.settings.config import load_config
from tokenloom.store.celery_app import queue_keys, queue_name
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_service import cancel
from tokenloom.store.jobs.job_store import ClaimOutcome, JobResult, JobStore
from tokenloom.store.jobs.streams import stream_key
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Batch, BatchStatus, Job, JobStatus, utcnow

LEASE_S = 60.0
MAX_NUM_SEQS = 2
NUM_JOBS = 6
# The jobs must still be running when the cancel arrives, on any CPU: their prompts carry the
# engine's stall marker (engine/testing/fault_injection.py, armed for this worker), so each makes at most
# one token per STALL_STEP_S and cannot end by itself in under MAX_TOKENS * STALL_STEP_S = 400 s,
# far longer than this test runs. It acts on states (a job running with tokens streamed), never on
# a head start.
STALL_MARKER = "CANCEL-TEST-STALL"
MAX_MODEL_LEN = 8192
MAX_TOKENS = 8000
assert MAX_TOKENS * STALL_STEP_S >= 400


@pytest.fixture(scope="module")
def sessions(pg_url):
    engine = make_sql_engine(pg_url)
    yield make_session_factory(engine)
    engine.dispose()  # before pg_url drops the database


@pytest.fixture
def store(sessions) -> JobStore:
    return JobStore(sessions)


def _add(store: JobStore, status: JobStatus = JobStatus.QUEUED, **values) -> uuid.UUID:
    job = Job(model="m", prompt="hi", params={}, status=status, **values)
    with store.sessions.begin() as session:
        session.add(job)
    return job.id


def _expire_lease(store: JobStore, job_id: uuid.UUID) -> None:
    with store.sessions.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


# --- store transitions (Postgres) -------------------------------------------------------------


def test_queued_job_is_cancelled_at_once_and_never_claimed(store):
    job_id = _add(store)
    assert store.request_cancel([job_id]) == (1, 0)
    job = store.get(job_id)
    assert job.status is JobStatus.CANCELLED
    assert job.finished_at is not None and job.error == "cancelled before it started"
    assert store.claim(job_id, "w1", LEASE_S, 3) is ClaimOutcome.ALREADY_DONE
    assert store.get(job_id).attempts == 0


def test_running_job_becomes_cancelling_and_its_worker_records_cancelled(store):
    job_id = _add(store)
    assert store.claim(job_id, "w1", LEASE_S, 3) is ClaimOutcome.CLAIMED
    assert store.cancel_requested_among([job_id]) == set()
    assert store.request_cancel([job_id]) == (0, 1)
    assert store.get(job_id).status is JobStatus.CANCELLING
    assert store.cancel_requested_among([job_id]) == {job_id}
    # Another worker can not take it; its own worker still holds the lease while aborting.
    assert store.claim(job_id, "w2", LEASE_S, 3) is ClaimOutcome.OWNED_ELSEWHERE
    store.finish_orphaned_cancels()  # its lease is live: not an orphan
    assert store.get(job_id).status is JobStatus.CANCELLING
    result = JobResult(JobStatus.CANCELLED, output_text="par", completion_tokens=3, finish_reason="abort")
    assert store.finish(job_id, "w1", result)
    job = store.get(job_id)
    assert (job.status, job.output_text, job.completion_tokens, job.attempts) == (JobStatus.CANCELLED, "par", 3, 1)


def test_terminal_jobs_are_untouched(store):
    ids = {
        status: _add(store, status, finished_at=utcnow(), error=f"was {status.value}")
        for status in TERMINAL_JOB_STATUSES
    }
    assert store.request_cancel(list(ids.values())) == (0, 0)
    for status, job_id in ids.items():
        job = store.get(job_id)
        assert (job.status, job.error) == (status, f"was {status.value}")


def test_mixed_request_is_one_call(store):
    queued, running, done = _add(store), _add(store), _add(store, JobStatus.SUCCEEDED)
    store.claim(running, "w1", LEASE_S, 3)
    assert store.request_cancel([queued, running, done]) == (1, 1)
    assert [store.get(j).status for j in (queued, running, done)] == [
        JobStatus.CANCELLED,
        JobStatus.CANCELLING,
        JobStatus.SUCCEEDED,
    ]
    assert store.request_cancel([]) == (0, 0)


def test_cancelling_job_whose_worker_died_ends_cancelled_and_is_never_rerun(store):
    job_id = _add(store)
    store.claim(job_id, "dead-worker", LEASE_S, 3)
    store.request_cancel([job_id])
    _expire_lease(store, job_id)
    assert job_id not in {ref.id for ref in store.expired_running_jobs(limit=10_000)}  # never re-sent
    assert store.claim(job_id, "w2", LEASE_S, 3) is ClaimOutcome.OWNED_ELSEWHERE  # never re-claimed
    assert store.finish_orphaned_cancels() >= 1
    job = store.get(job_id)
    assert job.status is JobStatus.CANCELLED and job.finished_at is not None and job.attempts == 1
    assert store.claim(job_id, "w2", LEASE_S, 3) is ClaimOutcome.ALREADY_DONE
    # A late result from the dead attempt can not overwrite it either.
    assert not store.finish(job_id, "dead-worker", JobResult(JobStatus.SUCCEEDED, output_text="late"))


def test_service_cancels_a_job_or_a_whole_batch(store, sessions):
    with sessions.begin() as session:
        batch = Batch(model="m", status=BatchStatus.IN_PROGRESS, total=3)
        session.add(batch)
        session.flush()
        batch_id = batch.id
    jobs = [_add(store, batch_id=batch_id, custom_id=f"c{i}") for i in range(3)]
    store.claim(jobs[0], "w1", LEASE_S, 3)
    single = _add(store)

    assert cancel(sessions, single) == {
        "id": str(single),
        "kind": "job",
        "cancelled": 1,
        "cancelling": 0,
        "unchanged": 0,
    }
    assert cancel(sessions, str(batch_id)) == {
        "id": str(batch_id),
        "kind": "batch",
        "cancelled": 2,
        "cancelling": 1,
        "unchanged": 0,
    }
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch.status is BatchStatus.CANCELLING and batch.cancelling_at is not None
    with pytest.raises(LookupError, match="no job or batch"):
        cancel(sessions, uuid.uuid4())
    with pytest.raises(LookupError, match="not a job or batch id"):
        cancel(sessions, "nope")


# --- a real worker process ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory) -> Path:
    return build_random_checkpoint(
        tmp_path_factory.mktemp("cancel-model") / "llama",
        seed=0,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.1,
    )


@pytest.fixture(scope="module")
def worker(pg_url, long_context_checkpoint, tmp_path_factory):
    settings = {
        "TOKENLOOM_MODEL_NAME": str(long_context_checkpoint),
        "TOKENLOOM_MODEL_DTYPE": "float32",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TOKENLOOM_DATABASE_URL": pg_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}",
    }
    # As many job threads as engine slots, so the rest of the batch stays queued in Postgres.
    log_path = tmp_path_factory.mktemp("cancel-worker") / "worker.log"
    with running_worker(settings, MAX_NUM_SEQS, log_path) as env:
        yield env, log_path


def _cli(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _jobs(sessions, batch_id: uuid.UUID) -> list[Job]:
    with sessions() as session:
        return list(session.execute(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_number)).scalars())


def _wait_for(predicate, sessions, batch_id, what: str, timeout_s: float = 120) -> list[Job]:
    """Poll the batch's rows until `predicate` holds (the timeout only bounds a failing run)."""
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = _jobs(sessions, batch_id)
        if predicate(jobs):
            return jobs
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {[(j.status.value, j.completion_tokens) for j in jobs]}")
        time.sleep(0.1)


def _streamed_tokens(job: Job, broker_url: str) -> bool:
    client = redis.Redis.from_url(broker_url)
    try:
        return any(b'"event": "delta"' in fields[b"data"] for _, fields in client.xrange(stream_key(job.id)))
    finally:
        client.close()


def test_cancel_a_batch_aborts_running_jobs_and_never_starts_queued_ones(worker, sessions, tmp_path):
    worker_env, log_path = worker
    broker_url = load_config(None, env=worker_env).queue.broker_url
    source = tmp_path / "long.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "prompt": f"{STALL_MARKER} job {i}: go",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            )
            + "\n"
            for i in range(NUM_JOBS)
        )
    )
    submitted = _cli(worker_env, "submit", str(source))
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    batch_id = uuid.UUID(submitted.stdout.strip().splitlines()[-1])

    # Mid-generation: a job is running and has streamed tokens (it cannot finish: see STALL_MARKER).
    _wait_for(
        lambda jobs: any(j.status is JobStatus.RUNNING and _streamed_tokens(j, broker_url) for j in jobs),
        sessions,
        batch_id,
        "a running job with tokens",
    )

    cancelled = _cli(worker_env, "cancel", str(batch_id))
    assert cancelled.returncode == 0, cancelled.stderr[-3000:]
    counts = json.loads(cancelled.stdout)
    assert counts["kind"] == "batch" and counts["unchanged"] == 0
    assert counts["cancelled"] + counts["cancelling"] == NUM_JOBS
    assert 1 <= counts["cancelling"] <= 2 * MAX_NUM_SEQS  # a worker claims at most twice its engine batch

    jobs = _wait_for(
        lambda jobs: all(j.status in TERMINAL_JOB_STATUSES for j in jobs), sessions, batch_id, "every job to end"
    )
    assert [j.status for j in jobs] == [JobStatus.CANCELLED] * NUM_JOBS
    ran = [j for j in jobs if j.attempts > 0]
    never_started = [j for j in jobs if j.attempts == 0]
    assert len(ran) == counts["cancelling"] and len(never_started) == counts["cancelled"]
    for job in ran:  # aborted in the engine (generating, or claimed and waiting for a batch slot)
        assert job.attempts == 1
        assert 0 <= job.completion_tokens < MAX_TOKENS, job.completion_tokens
        assert len(job.output_token_ids) == job.completion_tokens
    partial = [job for job in ran if job.completion_tokens > 0]
    assert partial and all(job.output_text for job in partial)  # the partial output is kept
    for job in never_started:
        assert job.output_text is None and job.completion_tokens is None and job.admitted_at is None
        assert job.error == "cancelled before it started"

    # The worker took the queued jobs' messages afterwards and ran none of them: a batch message
    # claims queued lines (store/jobs/fair_claim.py) and there are none. Wait until every message
    # of the model is consumed and acked (Kombu keeps delivered, unacked ones in its `unacked` hash),
    # then check that nothing changed.
    client = redis.Redis.from_url(broker_url)

    def answered_all() -> bool:
        waiting = sum(client.llen(key) for key in queue_keys(jobs[0].model))
        unacked = [json.loads(entry) for entry in client.hvals("unacked")]  # [message, exchange, routing key]
        return waiting == 0 and not [e for e in unacked if e[2] == queue_name(jobs[0].model)]

    deadline = time.monotonic() + 120
    while not answered_all():
        assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
        time.sleep(0.1)
    client.close()
    assert [(j.status, j.attempts) for j in _jobs(sessions, batch_id)] == [(j.status, j.attempts) for j in jobs]

    assert _cli(worker_env, "cancel", str(uuid.uuid4())).returncode == 1
