"""One thread that finalizes the batches whose jobs this worker just recorded.

Finalizing the last open batch job builds the batch's output files (store/batches/batch_finalizer.py),
which for a 50,000-line batch is far more work than recording a result, so it must not hold up
the ResultWriter. Batch ids arrive after every write round; each is checked once per wake-up
however many of its jobs were in the round, and only the caller that finds the batch done builds
its files (any number of workers may try at once). A failed finalization is logged: the next job
of the batch, or the reconciler's sweep of cancelling batches, tries again.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid

from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.batches.batch_finalizer import finalize_if_done

log = logging.getLogger("tokenloom.worker")


class BatchCloser:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions
        self._queue: queue.SimpleQueue[uuid.UUID] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name="tokenloom-batch-closer", daemon=True).start()

    def put(self, batch_id: uuid.UUID | None) -> None:
        """Check this batch soon (None: the job had no batch)."""
        if batch_id is not None:
            self._idle.clear()
            self._queue.put(batch_id)

    def wait_idle(self, timeout_s: float) -> bool:
        return self._idle.wait(timeout_s)

    def _run(self) -> None:
        while True:
            batch_ids = {self._queue.get()}
            while True:
                try:
                    batch_ids.add(self._queue.get_nowait())
                except queue.Empty:
                    break
            for batch_id in batch_ids:
                try:
                    finalize_if_done(self.sessions, batch_id)
                except Exception:  # the jobs' rows are written; a later call finalizes the batch
                    log.exception("batch %s: finalization failed; a later call will retry", batch_id)
            if self._queue.empty():
                self._idle.set()
