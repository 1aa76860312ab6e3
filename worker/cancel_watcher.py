"""One thread that notices the cancels of running jobs and aborts them in the engine.

Cancelling a running job only marks its row `cancelling` (store/jobs/job_service.py); the worker
running it finds out here. Every `poll_s` one query asks which of the jobs this worker holds are
cancelling, for all of them at once, and aborts those in the engine: the request ends with its
partial output, which is recorded as cancelled (worker/job_results.py asks `is_cancelled`).
Nothing else waits on a cancel. A failed query (a database outage) is let go: generation goes
on, and the next poll asks again.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("tokenloom.worker")

CANCEL_POLL_S = 0.5

Abort = Callable[[str], None]  # request id -> the engine stops that request (repeated aborts are no-ops)


class CancelSource(Protocol):
    """Where cancels are read from: the job store."""

    def cancel_requested_among(self, job_ids: list[uuid.UUID]) -> set[uuid.UUID]: ...


class HeldJobs(Protocol):
    """The jobs this worker runs (the claim budget); read with the shared lock held."""

    def holds(self, job_id: uuid.UUID) -> bool: ...

    def held_ids(self) -> list[uuid.UUID]: ...


class CancelWatcher:
    def __init__(
        self, source: CancelSource, held: HeldJobs, lock: threading.Lock, abort: Abort, poll_s: float = CANCEL_POLL_S
    ):
        self._source = source
        self._held = held
        # The JobRunner's lock, shared: a job that ends leaves the held jobs and the cancelled ones
        # in one step, so a cancel seen as it ends is never marked on a job no longer held.
        self._lock = lock
        self._abort = abort
        self.poll_s = poll_s
        self._cancelled: set[uuid.UUID] = set()  # cancel seen while running; cleared when the job ends
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CancelWatcher:
        self._thread = threading.Thread(target=self._run, name="tokenloom-cancel-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """No more polls; waits for a poll in progress to end (up to `timeout_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def is_cancelled(self, job_id: uuid.UUID) -> bool:
        """Whether a cancel was seen while this job ran. One set lookup: safe without the lock."""
        return job_id in self._cancelled

    def forget(self, job_id: uuid.UUID) -> None:
        """The job ended. Call with the shared lock held."""
        self._cancelled.discard(job_id)

    def poll(self) -> set[uuid.UUID]:
        """One round: mark and abort the held jobs that are cancelling; returns them."""
        with self._lock:
            held = self._held.held_ids()
        if not held:
            return set()
        try:
            cancelling = self._source.cancel_requested_among(held)
        except Exception as exc:  # database outage: keep generating, ask again next poll
            log.debug("cancel check failed: %s", exc)
            return set()
        with self._lock:
            cancelling = {job_id for job_id in cancelling if self._held.holds(job_id)}  # one that ended is not marked
            self._cancelled |= cancelling
        for job_id in cancelling:
            self._abort(str(job_id))
        return cancelling

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()
