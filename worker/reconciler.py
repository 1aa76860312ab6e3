"""Putting lost work back on the queue: Postgres is the truth, Redis messages can be lost.

Run by every worker on each heartbeat (any number may run at once: a job claimed twice still runs
once, because `JobStore.claim` is a conditional UPDATE). Three sweeps:

- orphans: running jobs whose lease expired (their worker died) are sent again;
- orphaned cancels: cancelling jobs whose worker died end cancelled, never re-run;
- stranded queued jobs: a worker that dies between receiving a message and claiming its row
  takes the message with it (Redis holds it for the 10-minute visibility timeout). A job still
  `queued` `stranded_after_s` after creation while its class's queue for its model is EMPTY
  cannot be waiting behind other messages of its class, so its message is gone or held by a dead
  worker: it is sent again. (A live worker claims a message within milliseconds of receiving it:
  prefetch = its threads.) The sweep goes class by class (the lists of store/celery_app.py's
  `class_queue_keys`), so a batch backlog never keeps a dead worker's chat requests waiting.
- Redis data loss: Redis in this stack may keep nothing on disk, so a restart drops every queued
  message. An "epoch" key is SET NX on each sweep; finding it gone means Redis lost its data (or
  this is the first worker ever), and every queued job is sent again, page by page. Duplicate
  messages for jobs whose message survived are harmless: the second claim finds the job taken.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Set

import redis
from sqlalchemy import select

from tokenloom.store.batches.batch_expiry import due_batches, expire_batch, expired_open_batches
from tokenloom.store.batches.batch_finalizer import finalize_if_done
from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.jobs import job_stats
from tokenloom.store.jobs.job_store import JobStore
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Batch, BatchStatus

log = logging.getLogger("tokenloom.worker")

EPOCH_KEY = "tokenloom:epoch"

SendJob = Callable[[uuid.UUID, str, WorkClass], None]  # (job id, model, class) -> message on its queue


class Reconciler:
    def __init__(
        self, store: JobStore, redis_client: redis.Redis, send_job: SendJob, stranded_after_s: float | None = None
    ):
        self.store = store
        self.redis = redis_client
        self.send_job = send_job
        self.stranded_after_s = stranded_after_s  # None: no stranded-job sweep

    def sweep(self, skip: Set[uuid.UUID] = frozenset()) -> None:
        """One pass of every check; `skip` = jobs this worker is running right now."""
        self.requeue_orphans(skip)
        self.resend_stranded()
        self.expire_due_batches()
        if self.store.finish_orphaned_cancels():
            self.finalize_cancelling_batches()
        self.resend_if_redis_lost_data()

    def requeue_orphans(self, skip: Set[uuid.UUID] = frozenset()) -> int:
        sent = 0
        for work_class in WorkClass:  # per class: a dead worker's batch lines never hide its chat requests
            for job_id, model, job_class in self.store.expired_running_jobs(work_class=work_class):
                if job_id in skip:  # our own job, its lease renewal was just delayed (database outage)
                    continue
                self.send_job(job_id, model, job_class)
                sent += 1
                log.info("re-sent job %s: its worker stopped renewing the lease", job_id)
        return sent

    def resend_stranded(self) -> int:
        """Per model and class: the jobs still queued `stranded_after_s` after creation while that
        class's queue for the model is empty are sent again, whatever the other classes hold."""
        if self.stranded_after_s is None:
            return 0
        models = job_stats.models_with_queued_jobs(self.store.sessions)
        keys = {model: class_queue_keys(model) for model in models}
        pipe = self.redis.pipeline(transaction=False)
        for model in models:
            for work_class in WorkClass:
                for key in keys[model][work_class]:
                    pipe.llen(key)
        lengths = iter(pipe.execute() if models else [])
        sent = 0
        for model in models:
            for work_class in WorkClass:
                if sum(next(lengths) for _ in keys[model][work_class]):
                    continue  # messages of this class are waiting: these jobs' may be among them
                refs = self.store.stale_queued_jobs(self.stranded_after_s, model=model, work_class=work_class)
                for ref in refs:
                    self.send_job(*ref)
                sent += len(refs)
                if refs:
                    log.warning(
                        "re-sent %d %s job(s) of %s still queued after %.0f s with an empty %s queue: their "
                        "messages were lost (e.g. held by a worker that died before claiming them)",
                        len(refs),
                        work_class.value,
                        model,
                        self.stranded_after_s,
                        work_class.value,
                    )
        return sent

    def expire_due_batches(self) -> int:
        """Batches whose completion window ended unfinished expire (store/batches/batch_expiry.py); one
        with nothing left running is finalized at once, the others by the worker recording their last
        aborted line."""
        due = due_batches(self.store.sessions)
        for batch_id in due:
            expire_batch(self.store.sessions, batch_id)
            finalize_if_done(self.store.sessions, batch_id)
        return len(due)

    def finalize_cancelling_batches(self) -> None:
        # Jobs whose worker died while being aborted were just ended here, not by a job thread:
        # the batches they belong to (being cancelled, or expired) may now be done.
        with self.store.sessions() as session:
            batch_ids = list(session.execute(select(Batch.id).where(Batch.status == BatchStatus.CANCELLING)).scalars())
        batch_ids += expired_open_batches(self.store.sessions)
        for batch_id in batch_ids:
            finalize_if_done(self.store.sessions, batch_id)

    def resend_if_redis_lost_data(self) -> int:
        if not self.redis.set(EPOCH_KEY, uuid.uuid4().hex, nx=True):
            return 0  # the key survived: so did the queued messages
        sent, after = 0, None
        while page := self.store.queued_jobs(after=after):
            for ref in page:
                self.send_job(*ref)
            sent += len(page)
            after = page[-1][0]
        if sent:
            log.warning(
                "Redis had no epoch marker (its first use, or a restart without persistence): "
                "re-sent %d queued jobs so none is lost",
                sent,
            )
        return sent
