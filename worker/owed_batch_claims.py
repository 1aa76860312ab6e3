"""Batch lines claimed without their messages, up to a worker's guaranteed share.

Jobs and batch lines share the model's queue at two Redis priority levels, and a claim thread
takes every waiting job message before any batch message: under a steady stream of /v1/jobs work
the batch messages never reach a thread, and the claim budget's guarantee for batch lines
(worker/claim_budget.py) has nothing to apply to. A batch message only says how many lines to
take (the lines are the model's queued ones, chosen fairly), so a worker need not wait for one:
while batch messages wait at Redis and this worker holds fewer batch lines than it is owed, this
thread claims the owed lines itself. The messages it ran ahead of later find fewer lines queued and
are acked after claiming what is left, so every line is still claimed once.
"""

from __future__ import annotations

import logging
import threading

import redis

from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.db_retry import is_outage
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.worker.job_runner import JobRunner

log = logging.getLogger("tokenloom.worker")

# How often the thread looks: a batch line that ends frees its seat for at most this long.
TICK_S = 0.5


class OwedBatchClaims:
    def __init__(self, runner: JobRunner, redis_client: redis.Redis, model: str, tick_s: float = TICK_S):
        self.runner = runner
        self.redis = redis_client
        self.model = model
        self.batch_keys = class_queue_keys(model)[WorkClass.BATCH]
        self.tick_s = tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tokenloom-owed-batch-claims", daemon=True)

    def start(self) -> "OwedBatchClaims":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def batch_messages_waiting(self) -> bool:
        return any(self.redis.llen(key) for key in self.batch_keys)

    def claim_once(self) -> int:
        """One look: claims the owed lines when batch messages wait at Redis; returns how many it claimed."""
        if not self.runner.owes_batch_lines() or not self.batch_messages_waiting():
            return 0
        return self.runner.claim_owed_batch_lines(self.model)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                claimed = self.claim_once()
            except Exception as exc:  # Redis or the database restarting: look again next tick
                level = logging.WARNING if not is_outage(exc) else logging.INFO
                log.log(level, "owed batch lines not claimed this time: %s", exc)
                continue
            if claimed:
                log.debug("claimed %d owed batch line(s) ahead of their messages", claimed)
