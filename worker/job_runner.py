"""Runs one job row through the shared engine: claim, stream deltas, write the outcome once.

Called from a Celery task thread; many run at once and all feed the same `EngineHost`, which is
what batches them. A job thread only waits for its request to end: deltas go from the engine
thread to one StreamPublisher (a Redis round trip per step, not per token), and cancels and
shutdown abort requests from the cancel watcher and `release_all`. The row is the source of truth: a job is only acked after `finish()`, and
every database call is retried through an outage (store/db_retry.py) so a finished result waits
in memory for the database instead of being lost. At shutdown, jobs still running past the
deadline are aborted and handed back to the queue (`release_all`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from functools import partial

from tokenloom.engine.engine_host import EngineHost
from tokenloom.engine.outputs import RequestOutput
from tokenloom.engine.sampling_params import InvalidRequestError, SamplingParams
from tokenloom.store.batch_finalizer import finalize_if_done
from tokenloom.store.db_retry import is_outage, with_db_retry
from tokenloom.store.job_store import ClaimOutcome, JobResult, JobStore
from tokenloom.store.models import Job, JobStatus, utcnow
from tokenloom.worker.stream_publisher import StreamPublisher
from tokenloom.store.streams import JobStreams, end_event

log = logging.getLogger("tokenloom.worker")

CANCEL_POLL_S = 0.5


class NotAdmitting(Exception):
    """The worker is shutting down: the job's message must go back to the queue untouched."""


class _Released:
    """What `_execute` returns for a job aborted by `release_all` (not a result to record)."""


RELEASED = _Released()


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        host: EngineHost,
        streams: JobStreams | None,
        worker_id: str,
        lease_s: float,
        max_attempts: int,
        requeue=None,
        db_retry_s: float = 300.0,
    ):
        self.store = store
        self.host = host
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.requeue = requeue  # (job id, model) -> message on the queue; needed by release_all
        self.db_retry_s = db_retry_s
        self._active: set[uuid.UUID] = set()
        self._lock = threading.Lock()
        self._admitting = True
        self._release = threading.Event()
        self._publisher = StreamPublisher(streams) if streams is not None else None
        # One thread asks the database which running jobs were cancelled, for all of them at once,
        # and aborts them in the engine; job threads just wait for their request to end.
        self._cancelled: set[uuid.UUID] = set()  # cancel seen while running; cleared when the job ends
        threading.Thread(target=self._watch_cancels, name="tokenloom-cancel-watch", daemon=True).start()

    def stop_admitting(self) -> None:
        """From now on `run` raises NotAdmitting instead of claiming (the worker is draining)."""
        self._admitting = False

    def release_all(self) -> None:
        """Abort every running job in the engine and hand it back to the queue, unfinished."""
        self._admitting = False
        self._release.set()  # before the aborts: a job submitted after this aborts itself
        for job_id in self.active_job_ids:
            self.host.abort(str(job_id))

    @property
    def active_job_ids(self) -> list[uuid.UUID]:
        with self._lock:
            return list(self._active)

    def run(self, job_id: str) -> ClaimOutcome:
        job_uuid = uuid.UUID(job_id)
        with self._lock:
            if not self._admitting:
                raise NotAdmitting(job_id)
            if job_uuid in self._active:  # a duplicate message for a job this process runs now
                return ClaimOutcome.OWNED_ELSEWHERE
            self._active.add(job_uuid)
        try:
            outcome = self._db(lambda: self.store.claim(job_uuid, self.worker_id, self.lease_s, self.max_attempts),
                               "claiming a job")
            if outcome is not ClaimOutcome.CLAIMED:
                log.info("job %s not run here: %s", job_id, outcome.value)
                if outcome is ClaimOutcome.TOO_MANY_ATTEMPTS:
                    self._finalize_batch(self.store.get(job_uuid))
                    self._close_stream(job_uuid, JobStatus.FAILED, None, "too many attempts")
                return outcome
            job = self._db(lambda: self.store.get(job_uuid), "reading a job")
            if job.attempts > 1:
                # An earlier attempt died mid-way and may have streamed tokens: readers start over.
                self._publish(job.id, {"event": "restart"})
            result = self._execute(job)
            if result is RELEASED:
                self._hand_back(job)
                return ClaimOutcome.RELEASED
            written = self._write_result(job_uuid, result)
        finally:
            with self._lock:
                self._active.discard(job_uuid)
                self._cancelled.discard(job_uuid)
        if written:
            self._finalize_batch(job)
            self._close_stream(job_uuid, result.status, result.finish_reason, result.error)
        else:
            log.warning("job %s: result dropped, the row was finished by another attempt", job_id)
        return outcome

    def _write_result(self, job_id: uuid.UUID, result: JobResult) -> bool:
        try:
            return self._db(lambda: self.store.finish(job_id, self.worker_id, result), "writing a result")
        except Exception as exc:
            if is_outage(exc):
                raise  # the lease expires and the job is re-run once the database is back
            # The database refused this result (not an outage): record why instead of leaving the
            # row running, where it would be re-run and fail again until max_attempts.
            log.exception("job %s: the database refused its result", job_id)
            failed = JobResult(JobStatus.FAILED, error=f"could not store the result: {exc}"[:2000])
            return self._db(lambda: self.store.finish(job_id, self.worker_id, failed), "writing a failure")

    def _db(self, call, what: str):
        return with_db_retry(call, what, self.db_retry_s)

    def _hand_back(self, job: Job) -> None:
        """Row back to queued (not counted as an attempt), then a new message; never lose it."""
        if not self._db(lambda: self.store.release(job.id, self.worker_id), "handing a job back"):
            return  # cancelled meanwhile, or no longer ours: its new owner records it
        try:
            self.requeue(job.id, job.model)
        except Exception as exc:  # Redis unreachable: let the reconciler of any worker re-send it
            log.warning("job %s: could not re-send (%s); it will be re-sent as an orphan", job.id, exc)
            self._db(lambda: self.store.mark_orphaned(job.id, self.worker_id), "marking a job orphaned")
        else:
            log.info("job %s handed back to the queue", job.id)
        self._publish(job.id, {"event": "restart"})  # stream readers drop what they saw: it starts over

    def _finalize_batch(self, job: Job | None) -> None:
        """If this was the batch's last open job, finalize the batch (one caller wins; see batch_finalizer)."""
        if job is None or job.batch_id is None:
            return
        try:
            finalize_if_done(self.store.sessions, job.batch_id)
        except Exception:  # finalization problems must never fail the job, whose row is already written
            log.exception("batch %s: finalization failed; a later call will retry", job.batch_id)

    def _execute(self, job: Job) -> JobResult:
        try:
            params = SamplingParams.from_dict(job.params or {}, self.host.engine.default_params)
        except InvalidRequestError as exc:
            return JobResult(JobStatus.FAILED, error=str(exc))
        submitted_wall, submitted_perf = utcnow(), time.perf_counter()
        on_output = None if self._publisher is None else partial(self._publisher.put_output, job.id)
        future = self.host.submit(
            str(job.id), job.prompt if job.prompt is not None else job.prompt_token_ids,
            messages=job.messages, params=params, priority=job.priority, on_output=on_output,
        )
        if self._release.is_set() or job.id in self._cancelled:
            self.host.abort(str(job.id))  # shutdown or cancel came while this job was being submitted
        try:
            output: RequestOutput = future.result()  # the cancel watcher / release_all abort it early
        except InvalidRequestError as exc:
            return JobResult(JobStatus.FAILED, error=str(exc))
        except Exception as exc:  # the engine failed this request; the worker carries on
            log.exception("job %s failed in the engine", job.id)
            return JobResult(JobStatus.FAILED, error=f"engine error: {exc}")
        cancelled = job.id in self._cancelled
        aborted = any(c.finish_reason == "abort" for c in output.outputs)
        if aborted and not cancelled and self._release.is_set():
            return RELEASED
        status = JobStatus.CANCELLED if cancelled else JobStatus.SUCCEEDED
        return _result_from_output(output, status, job, submitted_wall, submitted_perf)

    def _watch_cancels(self) -> None:
        while True:
            time.sleep(CANCEL_POLL_S)
            active = self.active_job_ids
            if not active:
                continue
            try:
                cancelling = self.store.cancel_requested_among(active)
            except Exception as exc:  # database outage: keep generating, ask again next poll
                log.debug("cancel check failed: %s", exc)
                continue
            with self._lock:
                cancelling &= self._active  # a job that ended meanwhile is not re-marked
                self._cancelled |= cancelling
            for job_id in cancelling:  # repeated aborts are no-ops in the engine
                self.host.abort(str(job_id))

    def _publish(self, job_id, event: dict) -> None:
        if self._publisher is not None:
            self._publisher.put_event(job_id, event)

    def _close_stream(self, job_id, status: JobStatus, finish_reason, error) -> None:
        self._publish(job_id, end_event(status.value, finish_reason, error))


def _result_from_output(output: RequestOutput, status: JobStatus, job: Job, submitted_wall, submitted_perf) -> JobResult:
    first = output.outputs[0]
    metrics = output.metrics
    # The job arrived when its row was created; the engine measures from submission.
    created = job.created_at if job.created_at.tzinfo else job.created_at.replace(tzinfo=submitted_wall.tzinfo)
    waited_s = (submitted_wall - created).total_seconds()
    choices = [
        {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
         "stop_reason": c.stop_reason,
         "logprobs": None if c.logprobs is None else [
             {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs]}
        for c in output.outputs
    ]
    return JobResult(
        status=status,
        output_text=first.text,
        output_token_ids=first.token_ids,
        choices=choices,
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=output.num_output_tokens,
        finish_reason=first.finish_reason,
        first_token_at=None if metrics.ttft_s is None else submitted_wall + timedelta(seconds=metrics.ttft_s),
        queue_s=None if metrics.queue_s is None else waited_s + metrics.queue_s,
        ttft_s=None if metrics.ttft_s is None else waited_s + metrics.ttft_s,
        tpot_s=metrics.tpot_s,
    )
