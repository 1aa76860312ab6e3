"""The stranded-job sweep (worker/reconciler.py) against a real Postgres and Redis: a job still
queued long after creation while its class's queue for its model is empty lost its message (a worker
died between receiving and claiming it) and is sent again, whatever other classes hold; jobs that may
still have a message are left alone."""

from __future__ import annotations

from datetime import timedelta

from tests.worker.test_reconciler import _add, store  # noqa: F401 - fixtures (redis_client: conftest.py)
from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus, utcnow
from tokenloom.worker.reconciler import EPOCH_KEY, Reconciler

STRANDED_AFTER_S = 20
BACKLOG = 150  # queued batch lines, more than one sweep's page of a class (100)


def _reconciler(store, redis_client, stranded_after_s=STRANDED_AFTER_S):
    sent = []
    return Reconciler(
        store,
        redis_client,
        lambda job_id, model, work_class: sent.append((job_id, model)),
        stranded_after_s=stranded_after_s,
    ), sent


def test_an_old_queued_job_with_an_empty_queue_is_sent_again(store, redis_client):  # noqa: F811
    old = utcnow() - timedelta(seconds=STRANDED_AFTER_S + 5)
    stranded = _add(store, model="qwen", created_at=old)
    _add(store, model="qwen")  # just created: its message is surely still on its way
    _add(store, JobStatus.RUNNING, model="qwen", created_at=old)  # claimed: not the sweep's business
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_stranded() == 1
    assert sent == [(stranded, "qwen")]


def test_nothing_is_sent_while_its_class_queue_holds_messages(store, redis_client):  # noqa: F811
    _add(store, model="qwen", created_at=utcnow() - timedelta(seconds=STRANDED_AFTER_S + 5))  # class: jobs
    redis_client.rpush(class_queue_keys("qwen")[WorkClass.JOBS][-1], b"a waiting message")  # any of its levels
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_stranded() == 0 and sent == []


def test_stranded_interactive_and_jobs_are_sent_again_behind_a_batch_backlog(store, redis_client):  # noqa: F811
    # A backlog: more old queued batch lines than one sweep reads (it once read the 100 oldest jobs of
    # every class together), and their messages waiting on the model's queue.
    long_ago = utcnow() - timedelta(hours=1)
    with store.sessions.begin() as session:
        session.add_all(
            Job(model="qwen", prompt="line", params={}, work_class=WorkClass.BATCH, created_at=long_ago)
            for _ in range(BACKLOG)
        )
    redis_client.rpush(class_queue_keys("qwen")[WorkClass.BATCH][0], *[b"a batch message"] * 10)
    old = utcnow() - timedelta(seconds=STRANDED_AFTER_S + 5)
    chats = {_add(store, model="qwen", created_at=old, work_class=WorkClass.INTERACTIVE) for _ in range(3)}
    polled = _add(store, model="qwen", created_at=old, work_class=WorkClass.JOBS)
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_stranded() == 4
    # Interactive first, then jobs; no batch line: messages of their class are waiting.
    assert {job_id for job_id, _ in sent[:3]} == chats and sent[3] == (polled, "qwen")


def test_a_class_with_waiting_messages_keeps_its_jobs_while_another_class_is_sent(store, redis_client):  # noqa: F811
    old = utcnow() - timedelta(seconds=STRANDED_AFTER_S + 5)
    chat = _add(store, model="qwen", created_at=old, work_class=WorkClass.INTERACTIVE)
    _add(store, model="qwen", created_at=old, work_class=WorkClass.JOBS)
    redis_client.rpush(class_queue_keys("qwen")[WorkClass.JOBS][0], b"a waiting job message")
    line = _add(store, model="other", created_at=old, work_class=WorkClass.BATCH)  # another model: its own queues
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_stranded() == 2
    assert sorted(sent) == sorted([(chat, "qwen"), (line, "other")])


def test_the_sweep_is_off_without_a_threshold(store, redis_client):  # noqa: F811
    _add(store, model="qwen", created_at=utcnow() - timedelta(hours=1))
    redis_client.set(EPOCH_KEY, "kept")  # Redis did not lose its data: that sweep sends nothing
    reconciler, sent = _reconciler(store, redis_client, stranded_after_s=None)
    reconciler.sweep()
    assert sent == []
    reconciler.stranded_after_s = STRANDED_AFTER_S
    reconciler.sweep()
    assert [model for _, model in sent] == ["qwen"]
