"""A batch whose completion window ends unfinished expires, as OpenAI's do.

At its `expires_at` (created + `completion_window`) a batch still in progress is marked expired
(`expired_at`): in one transaction its queued lines end `failed` with code `batch_expired` (so no
worker claims them: their messages find nothing to run) and its running lines become `cancelling`,
which their workers abort within a cancel poll. Once none runs the finalizer writes the files as
OpenAI does: every line done before the window ended in the output file, every other line in the
error file as `batch_expired` (an aborted line's partial output is dropped), and the batch ends
`expired`. Lines that finish while the abort is on its way are kept as done. The sweep runs with
every worker's heartbeat (worker/reconciler.py), so a batch expires within a heartbeat of its
window, whichever worker is alive.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.database import rowcount
from tokenloom.store.models import Batch, BatchStatus, Job, JobErrorCode, JobStatus, utcnow

log = logging.getLogger(__name__)

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
# Only a batch in progress expires: one being cancelled ends cancelled, one finalizing has ended.
EXPIRABLE_STATUSES = (BatchStatus.IN_PROGRESS,)


def due_batches(sessions: sessionmaker[Session]) -> list[uuid.UUID]:
    """Batches in progress whose window has ended and that are not marked expired yet."""
    with sessions() as session:
        return list(
            session.scalars(
                select(Batch.id).where(
                    Batch.status.in_(EXPIRABLE_STATUSES),
                    Batch.expires_at < utcnow(),
                    Batch.expired_at.is_(None),
                )
            )
        )


def expire_batch(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> tuple[int, int]:
    """Mark the batch expired: (queued lines failed as batch_expired, running lines being aborted).
    (0, 0) and nothing changed when it is no longer in progress or already marked."""
    now = utcnow()
    with sessions.begin() as session:
        batch = session.get(Batch, batch_id, with_for_update=True)
        if batch is None or batch.status not in EXPIRABLE_STATUSES or batch.expired_at is not None:
            return 0, 0
        batch.expired_at = now
        failed = rowcount(
            session.execute(
                update(Job)
                .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
                .values(
                    status=JobStatus.FAILED,
                    error_code=JobErrorCode.BATCH_EXPIRED,
                    error=EXPIRED_MESSAGE,
                    finished_at=now,
                )
                .execution_options(synchronize_session=False)
            )
        )
        aborting = rowcount(
            session.execute(
                update(Job)
                .where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)
                .values(status=JobStatus.CANCELLING)
                .execution_options(synchronize_session=False)
            )
        )
    log.info(
        "batch %s expired: %d queued lines failed as batch_expired, %d running being aborted",
        batch_id,
        failed,
        aborting,
    )
    return failed, aborting


def mark_aborted_lines_expired(session: Session, batch_id: uuid.UUID) -> None:
    """At finalization of an expired batch: the lines aborted because it expired (cancelled) are
    `batch_expired` failures, as OpenAI reports every line the window did not reach."""
    session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.CANCELLED)
        .values(status=JobStatus.FAILED, error_code=JobErrorCode.BATCH_EXPIRED, error=EXPIRED_MESSAGE)
        .execution_options(synchronize_session=False)
    )


def expired_open_batches(sessions: sessionmaker[Session]) -> list[uuid.UUID]:
    """Batches marked expired that are not final yet: the reconciler finalizes those whose last
    aborted line ended without a worker to finalize it (its worker died)."""
    with sessions() as session:
        return list(
            session.scalars(select(Batch.id).where(Batch.status.in_(EXPIRABLE_STATUSES), Batch.expired_at.is_not(None)))
        )
