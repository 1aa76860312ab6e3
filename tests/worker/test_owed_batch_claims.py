"""worker/owed_batch_claims.py with a real Redis: it claims a worker's owed batch lines only while
batch messages wait at Redis and the worker owes some, and a look that finds no line backs off."""

from __future__ import annotations

import pytest
import redis

from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker import owed_batch_claims
from tokenloom.worker.owed_batch_claims import OwedBatchClaims

MODEL = "owed-model"


class RecordingRunner:
    """The two JobRunner calls the thread makes (JobRunner itself is tested through real workers)."""

    def __init__(self, owes: bool, lines_queued: int):
        self.owes, self.lines_queued = owes, lines_queued
        self.claims: list[str] = []

    def owes_batch_lines(self) -> bool:
        return self.owes

    def claim_owed_batch_lines(self, model: str) -> int:
        self.claims.append(model)
        taken, self.lines_queued = min(1, self.lines_queued), max(0, self.lines_queued - 1)
        return taken


def test_it_claims_only_while_batch_messages_wait_and_lines_are_owed(redis_client):
    runner = RecordingRunner(owes=True, lines_queued=2)
    keeper = OwedBatchClaims(runner, redis_client, MODEL)  # type: ignore[arg-type]
    assert keeper.claim_once() is None and runner.claims == []  # no batch message waits: the messages will come
    redis_client.lpush(class_queue_keys(MODEL)[WorkClass.JOBS][0], "a job message")
    assert keeper.claim_once() is None  # job messages are not batch messages
    redis_client.lpush(class_queue_keys(MODEL)[WorkClass.BATCH][0], "a batch message")
    assert keeper.claim_once() == 1 and runner.claims == [MODEL]
    runner.owes = False
    assert keeper.claim_once() is None and len(runner.claims) == 1  # at its share: nothing owed


def test_a_look_that_finds_no_line_backs_off(redis_client):
    runner = RecordingRunner(owes=True, lines_queued=0)
    redis_client.lpush(class_queue_keys(MODEL)[WorkClass.BATCH][0], "a batch message whose lines are taken")
    keeper = OwedBatchClaims(runner, redis_client, MODEL, tick_s=0.5)  # type: ignore[arg-type]
    found_none = keeper.claim_once()
    assert found_none == 0 and keeper.next_wait_s(found_none) == owed_batch_claims.FRUITLESS_BACKOFF_S
    assert keeper.next_wait_s(1) == keeper.next_wait_s(None) == 0.5  # claimed, or did not try: the next tick
