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
# After a look that found no queued line (the messages left at Redis are for lines claimed already,
# by this thread or other workers), the next waits this long: no claim query twice a second for nothing.
FRUITLESS_BACKOFF_S = 5.0


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

    def claim_once(self) -> int | None:
        """One look: claims the owed lines when batch messages wait at Redis; returns how many it
        claimed, or None when it did not try (nothing owed, or no batch message waiting)."""
        if not self.runner.owes_batch_lines() or not self.batch_messages_waiting():
            return None
        return self.runner.claim_owed_batch_lines(self.model)

    def next_wait_s(self, claimed: int | None) -> float:
        """How long to wait after a look that claimed `claimed` lines (None: it did not try)."""
        return FRUITLESS_BACKOFF_S if claimed == 0 else self.tick_s

    def _loop(self) -> None:
        wait_s = self.tick_s
        while not self._stop.wait(wait_s):
            try:
                claimed = self.claim_once()
            except Exception as exc:  # Redis or the database restarting: look again next tick
                level = logging.WARNING if not is_outage(exc) else logging.INFO
                log.log(level, "owed batch lines not claimed this time: %s", exc)
                claimed = None
            if claimed:
                log.debug("claimed %d owed batch line(s) ahead of their messages", claimed)
            wait_s = self.next_wait_s(claimed)
