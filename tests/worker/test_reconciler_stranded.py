"""The stranded-job sweep (worker/reconciler.py) against a real Postgres and Redis: a job still
queued long after creation while its model's queue is empty lost its message (a worker died between
receiving and claiming it) and is sent again; jobs that may still have a message are left alone."""

from __future__ import annotations

from datetime import timedelta

from tests.worker.test_reconciler import _add, redis_client, store  # noqa: F401 - fixtures
from tokenloom.store.celery_app import queue_keys
from tokenloom.store.models import JobStatus, utcnow
from tokenloom.worker.reconciler import EPOCH_KEY, Reconciler

STRANDED_AFTER_S = 20


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


def test_nothing_is_sent_while_the_models_queue_holds_messages(store, redis_client):  # noqa: F811
    _add(store, model="qwen", created_at=utcnow() - timedelta(seconds=STRANDED_AFTER_S + 5))
    redis_client.rpush(queue_keys("qwen")[-1], b"a waiting message")  # any priority level counts
    reconciler, sent = _reconciler(store, redis_client)
    assert reconciler.resend_stranded() == 0 and sent == []


def test_the_sweep_is_off_without_a_threshold(store, redis_client):  # noqa: F811
    _add(store, model="qwen", created_at=utcnow() - timedelta(hours=1))
    redis_client.set(EPOCH_KEY, "kept")  # Redis did not lose its data: that sweep sends nothing
    reconciler, sent = _reconciler(store, redis_client, stranded_after_s=None)
    reconciler.sweep()
    assert sent == []
    reconciler.stranded_after_s = STRANDED_AFTER_S
    reconciler.sweep()
    assert [model for _, model in sent] == ["qwen"]
