"""Everything one worker process owns: the engine on its thread, the job store, streams, leases.

Built once per process (lazily, on the first task or at worker start) and shared by all task
threads. Its heartbeat keeps the leases of running jobs fresh and runs the reconciler (re-sends
jobs of dead workers, and queued jobs after Redis lost its data). On SIGTERM it drains: running
jobs get `[queue] shutdown_timeout_s` to finish, then the rest are handed back to the queue.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis
from celery import Celery

from tokenloom.engine import Engine, EngineHost
from tokenloom.settings.config import TokenloomConfig
from tokenloom.settings.fault_injection_env import fault_injector_from_env
from tokenloom.store.celery_app import send_job, send_jobs
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.engine_stats import publish_engine_stats
from tokenloom.store.jobs.job_store import JobStore
from tokenloom.store.jobs.streams import JobStreams
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.retention import prune_if_due
from tokenloom.worker.interactive_lane import InteractiveLane
from tokenloom.worker.job_runner import JobRunner
from tokenloom.worker.owed_batch_claims import OwedBatchClaims
from tokenloom.worker.reconciler import Reconciler

log = logging.getLogger("tokenloom.worker")


class WorkerRuntime:
    def __init__(self, config: TokenloomConfig, app: Celery, engine: Engine | None = None):
        self.config = config
        self.app = app
        self.host = EngineHost(
            engine or (lambda: Engine(config, faults=fault_injector_from_env()))
        ).start()  # built on the engine thread
        assert self.host.engine is not None  # start() returns once the engine is built (or raises)
        self.engine = self.host.engine
        self.store = JobStore(make_session_factory(make_sql_engine(config.database.url)))
        redis_client = redis.Redis.from_url(config.queue.broker_url)
        self.streams = JobStreams(redis_client, config.queue.result_stream_maxlen)
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.lease_s = config.queue.lease_s
        self.runner = JobRunner(
            self.store,
            self.host,
            self.streams,
            self.worker_id,
            self.lease_s,
            config.queue.max_attempts,
            requeue=self.send_jobs,
            db_retry_s=config.database.retry_s,
            # Twice the engine's batch: the next jobs are claimed while the current ones run.
            max_in_flight=2 * self.engine.config.scheduler.max_num_seqs,  # resolved for the device
            min_claim_share=config.queue.min_claim_share,
            max_prompt_logprob_entries=config.server.max_prompt_logprob_entries,
        )
        # Interactive messages are consumed on a thread of their own, never behind batch messages.
        self.lane = InteractiveLane(app, self.engine.model_name, self.runner).start()
        # Batch lines owed to this worker are claimed even while job messages keep their messages back.
        self.owed_batch = OwedBatchClaims(self.runner, redis_client, self.engine.model_name).start()
        # Stranded after 2 leases: far longer than a live worker takes to claim what it received.
        self.reconciler = Reconciler(self.store, redis_client, self.send_job, stranded_after_s=2 * self.lease_s)
        self._redis = redis_client
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tokenloom-heartbeat", daemon=True)
        self._heartbeat.start()
        self._drain: threading.Thread | None = None

    def send_job(self, job_id, model: str, work_class: WorkClass) -> None:
        send_job(self.app, job_id, model, work_class)

    def send_jobs(self, model: str, job_ids, work_class: WorkClass) -> None:
        send_jobs(self.app, model, job_ids, self.config.queue.group_size, work_class)

    def begin_shutdown(self, timeout_s: float | None = None) -> None:
        """Stop taking jobs; let running ones finish for `timeout_s`, then hand the rest back.

        Returns at once (it is called from a signal handler). Task threads return as soon as
        their jobs are claimed, so Celery's warm shutdown ends quickly; `close()` then waits for
        this drain: the jobs finish or go back to the queue before the process exits.
        """
        if self._drain is not None:
            if timeout_s == 0:  # a second signal: hand everything back now
                self.runner.release_all()
            return
        timeout_s = self.config.queue.shutdown_timeout_s if timeout_s is None else timeout_s
        self.lane.should_stop = True  # its unclaimed messages stay in Redis for the other workers
        self.owed_batch.stop(timeout_s=0)  # claims nothing more (the runner also stops admitting)
        self.runner.stop_admitting()
        running = len(self.runner.active_job_ids)
        log.warning(
            "shutting down: %d running job(s) get %.0f s to finish, then go back to the queue", running, timeout_s
        )
        self._drain = threading.Thread(
            target=self._drain_then_release, args=(timeout_s,), name="tokenloom-drain", daemon=True
        )
        self._drain.start()

    def _drain_then_release(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.runner.active_job_ids and time.monotonic() < deadline:
            time.sleep(0.1)
        left = len(self.runner.active_job_ids)
        if left:
            log.warning("shutdown timeout: handing %d unfinished job(s) back to the queue", left)
            self.runner.release_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Drain (if no signal started it), wait until every job is recorded or handed back, stop."""
        self.begin_shutdown()
        assert self._drain is not None  # begin_shutdown started it, now or on a signal
        self._drain.join()
        if not self.runner.wait_idle(timeout_s + self.config.database.retry_s):
            log.warning(
                "stopping with %d job(s) unrecorded: their leases expire and they run again elsewhere",
                len(self.runner.active_job_ids),
            )
        self.runner.close()
        self._stop.set()
        self.lane.stop()
        self.owed_batch.stop()
        self.host.stop(timeout_s)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                active = self.runner.active_job_ids
                self.store.renew_leases(active, self.worker_id, self.lease_s)
                self.reconciler.sweep(skip=set(active))
                prune_if_due(self.store.sessions, self._redis, self.config.database.retention_days)
            except Exception as exc:  # the database or Redis may be restarting; try again next beat
                log.warning("heartbeat failed: %s", exc)
            try:  # figures for the API's /metrics; they expire if this worker dies
                publish_engine_stats(self._redis, self.worker_id, self.engine, ttl_s=3 * self.lease_s)
            except Exception as exc:
                log.debug("engine stats not published: %s", exc)


_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()


def get_runtime(config: TokenloomConfig, app: Celery) -> WorkerRuntime:
    global _runtime  # one engine per process, created by whichever thread needs it first
    with _runtime_lock:
        if _runtime is None:
            _runtime = WorkerRuntime(config, app)
        return _runtime
