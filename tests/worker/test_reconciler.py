"""The reconciler against a real Postgres and a real Redis: orphans and jobs whose messages Redis
lost are sent again; live jobs are left alone."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import redis
from sqlalchemy import delete
from sqlalchemy.exc import OperationalError

from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.db_retry import is_outage, with_db_retry
from tokenloom.store.jobs.job_store import JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus, utcnow
from tokenloom.worker.reconciler import EPOCH_KEY, Reconciler


@pytest.fixture
def store(pg_url):
    engine = make_sql_engine(pg_url)
    sessions = make_session_factory(engine)
    with sessions.begin() as session:
        session.execute(delete(Job))
    yield JobStore(sessions)
    engine.dispose()


def _add(store, status=JobStatus.QUEUED, model="m", **values) -> uuid.UUID:
    job = Job(model=model, prompt="hi", params={}, status=status, **values)
    with store.sessions.begin() as session:
        session.add(job)
    return job.id


def _reconciler(store, redis_client):
    sent: list[tuple[uuid.UUID, str]] = []
    return Reconciler(store, redis_client, lambda job_id, model, work_class: sent.append((job_id, model))), sent


def test_orphans_are_resent_to_their_models_queue_but_not_our_own_jobs(store, redis_client):
    past = utcnow() - timedelta(seconds=1)
    orphan = _add(store, JobStatus.RUNNING, model="qwen", worker_id="dead", lease_expires_at=past)
    ours = _add(store, JobStatus.RUNNING, worker_id="me", lease_expires_at=past)
    _add(store, JobStatus.RUNNING, worker_id="alive", lease_expires_at=utcnow() + timedelta(seconds=60))
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.requeue_orphans(skip={ours}) == 1
    assert sent == [(orphan, "qwen")]


def test_orphans_are_found_class_by_class_so_batch_orphans_never_hide_a_chat(store, redis_client):
    past = utcnow() - timedelta(seconds=1)
    dead = dict(status=JobStatus.RUNNING, model="qwen", worker_id="dead", lease_expires_at=past)
    with store.sessions.begin() as session:  # more batch orphans than one sweep's page of a class (100)
        session.add_all(Job(prompt="line", params={}, work_class=WorkClass.BATCH, **dead) for _ in range(150))
    chat = _add(store, work_class=WorkClass.INTERACTIVE, **dead)
    classes: list[WorkClass] = []
    reconciler = Reconciler(store, redis_client, lambda job_id, model, work_class: classes.append(work_class))
    assert reconciler.requeue_orphans() == 1 + 100
    assert classes[0] is WorkClass.INTERACTIVE and classes[1:] == [WorkClass.BATCH] * 100
    assert chat in {ref.id for ref in store.expired_running_jobs(work_class=WorkClass.INTERACTIVE)}


def test_queued_jobs_are_resent_only_when_redis_lost_its_data(store, redis_client):
    queued = {_add(store) for _ in range(3)}
    _add(store, JobStatus.SUCCEEDED)
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_if_redis_lost_data() == 3  # no marker yet: first use
    assert {job_id for job_id, _ in sent} == queued
    assert reconciler.resend_if_redis_lost_data() == 0  # marker present: messages are there
    redis_client.delete(EPOCH_KEY)  # what a restart without persistence does
    assert reconciler.resend_if_redis_lost_data() == 3


def test_sweep_ends_cancelling_jobs_whose_worker_died(store, redis_client):
    job_id = _add(store, JobStatus.CANCELLING, worker_id="dead", lease_expires_at=utcnow() - timedelta(seconds=1))
    reconciler, sent = _reconciler(store, redis_client)
    reconciler.sweep()
    assert store.get(job_id).status is JobStatus.CANCELLED
    assert job_id not in {j for j, _ in sent}


def test_db_retry_retries_outages_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        return "ok"

    assert with_db_retry(flaky, "testing", budget_s=30) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):  # a bug is not an outage: raised at once
        with_db_retry(lambda: (_ for _ in ()).throw(ValueError("bug")), "testing", budget_s=30)
    assert is_outage(OperationalError("x", {}, Exception())) and not is_outage(ValueError())
