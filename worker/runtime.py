"""Everything one worker process owns: the engine on its thread, the job store, streams, leases.

Built once per process (lazily, on the first task or at worker start) and shared by all task
threads; its heartbeat keeps the leases of running jobs fresh and its reconciler re-sends jobs whose
worker died (their leases expired).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import redis
from celery import Celery

from engine.config import TokenloomConfig
from engine.engine import Engine
from engine.engine_host import EngineHost
from sqlalchemy import select

from worker.batch_finalizer import finalize_if_done
from worker.celery_app import send_job
from worker.database import make_session_factory, make_sql_engine
from worker.job_runner import JobRunner
from worker.job_store import JobStore
from worker.models import Batch, BatchStatus
from worker.streams import JobStreams

log = logging.getLogger("tokenloom.worker")

LEASE_S = 30.0  # a job whose worker misses this many seconds of heartbeats is considered orphaned


class WorkerRuntime:
    def __init__(self, config: TokenloomConfig, app: Celery, engine: Engine | None = None):
        self.config = config
        self.app = app
        self.engine = engine or Engine(config)
        self.host = EngineHost(self.engine).start()
        self.store = JobStore(make_session_factory(make_sql_engine(config.database.url)))
        self.streams = JobStreams(redis.Redis.from_url(config.queue.broker_url), config.queue.result_stream_maxlen)
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.runner = JobRunner(
            self.store, self.host, self.streams, self.worker_id, LEASE_S, config.queue.max_attempts
        )
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tokenloom-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.host.stop(timeout_s)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                self.store.renew_leases(self.runner.active_job_ids, self.worker_id, LEASE_S)
                self._requeue_orphans()
                if self.store.finish_orphaned_cancels():
                    self._finalize_cancelling_batches()
            except Exception as exc:  # the database may be restarting; try again next beat
                log.warning("heartbeat failed: %s", exc)

    def _finalize_cancelling_batches(self) -> None:
        # Jobs whose worker died while being aborted were just ended here, not by a job thread:
        # the batches they belong to may now be done.
        with self.store.sessions() as session:
            batch_ids = list(session.execute(select(Batch.id).where(Batch.status == BatchStatus.CANCELLING)).scalars())
        for batch_id in batch_ids:
            finalize_if_done(self.store.sessions, batch_id)

    def _requeue_orphans(self) -> None:
        for job_id in self.store.expired_running_jobs():
            # The claim in JobRunner.run re-checks the lease, so two workers re-sending the same
            # orphan still run it once.
            send_job(self.app, job_id, self.engine.model_name)
            log.info("re-sent job %s: its worker stopped renewing the lease", job_id)


_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime(config: TokenloomConfig, app: Celery) -> WorkerRuntime:
    global _runtime  # one engine per process, created by whichever thread needs it first
    with _runtime_lock:
        if _runtime is None:
            _runtime = WorkerRuntime(config, app)
        return _runtime
