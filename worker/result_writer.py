"""One thread that records finished jobs in groups: one UPDATE per round, not one per job.

Engine futures resolve on the engine thread, which must never wait on I/O; their done-callbacks
only append to this writer's queue. The writer drains everything that accumulated (a step
finishes many jobs at once), turns each into its row values and writes them all with
`JobStore.finish_many`, one round trip. Through a database outage it retries for `[database]
retry_s` while results wait in memory; past that, the jobs are given up here (their leases
expire and any worker's reconciler runs them again: conditional writes keep the effect exactly
once). A round the database refuses for another reason (a bad value) is split and written job
by job, so one bad result fails only its own job, recorded with the reason.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tokenloom.store.db_retry import is_outage, with_db_retry
from tokenloom.store.jobs.job_store import JobResult, JobStore
from tokenloom.store.models import Job, JobErrorCode

log = logging.getLogger("tokenloom.worker")

MAX_RESULTS_PER_ROUND = 1024


@dataclass(slots=True)
class FinishedJob:
    job: Job
    # Builds the row values (None: the job was released to the queue, nothing to write). Runs on
    # the writer thread, so converting outputs never costs the engine thread time.
    outcome: Callable[[], JobResult | None]


# (job, result or None when released, written, error when it could not be recorded)
Settle = Callable[[FinishedJob, JobResult | None, bool, BaseException | None], None]


class ResultWriter:
    def __init__(self, store: JobStore, worker_id: str, db_retry_s: float, settle: Settle):
        self.store = store
        self.worker_id = worker_id
        self.db_retry_s = db_retry_s
        self._settle = settle
        self._queue: queue.SimpleQueue[FinishedJob] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tokenloom-results", daemon=True).start()

    def put(self, finished: FinishedJob) -> None:
        """Queue a finished job (called from the engine thread's done-callbacks: never blocks)."""
        self._queue.put(finished)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_RESULTS_PER_ROUND:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._record(batch)
            except Exception as exc:  # never let the writer thread die
                log.exception("recording %d results failed", len(batch))
                for finished in batch:
                    self._settle(finished, None, False, exc)

    def _record(self, batch: list[FinishedJob]) -> None:
        to_write: list[tuple[FinishedJob, JobResult]] = []
        for finished in batch:
            try:
                result = finished.outcome()
            except Exception as exc:  # a conversion bug must fail this job only
                log.exception("job %s: its output could not be read", finished.job.id)
                result = JobResult.failed(
                    JobErrorCode.RESULT_UNSTORED, f"could not read the engine output: {exc}"[:2000]
                )
            if result is None:
                self._settle(finished, None, False, None)
            else:
                to_write.append((finished, result))
        if not to_write:
            return
        try:
            written = self._write([(finished.job.id, result) for finished, result in to_write])
        except Exception as exc:  # an outage past the retry budget
            for finished, _ in to_write:
                self._settle(finished, None, False, exc)
            return
        for finished, result in to_write:
            self._settle(finished, result, finished.job.id in written, None)

    def _write(self, rows: list[tuple]) -> set:
        try:
            return self._db(lambda: self.store.finish_many(self.worker_id, rows), "writing results")
        except Exception as exc:
            if is_outage(exc):
                raise
            if len(rows) == 1:
                return self._write_refused(rows[0][0], exc)
        written = set()
        for row in rows:  # find the row the database refuses; the others are written as they are
            written |= self._write([row])
        return written

    def _write_refused(self, job_id, exc: Exception) -> set:
        # The database refused this result (not an outage): record why instead of leaving the row
        # running, where it would be re-run and fail again until max_attempts.
        log.error("job %s: the database refused its result: %s", job_id, exc)
        failed = JobResult.failed(JobErrorCode.RESULT_UNSTORED, f"could not store the result: {exc}"[:2000])
        return self._db(lambda: self.store.finish_many(self.worker_id, [(job_id, failed)]), "writing a failure")

    def _db(self, call, what: str):
        return with_db_retry(call, what, self.db_retry_s)
