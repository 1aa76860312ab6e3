"""Retention: delete finished jobs, batches and files older than a cutoff, and their stream keys.

What goes (cutoff = now - older_than):
- jobs outside any batch that are terminal (succeeded, failed, cancelled) and finished before the
  cutoff. A job of a batch goes only with its batch: the batch's counts and output are read from
  its job rows, so deleting some of them would change what a kept batch reports;
- batches that are terminal (completed, failed, cancelled, expired), ended (completed_at,
  failed_at or cancelled_at) before the cutoff, and have no job left that is not terminal:
  their terminal jobs first, in pages, then the batch row once it has no jobs;
- files created before the cutoff that no remaining batch references (a file lives as long as
  the batch that reads or wrote it; batches.*_file_id have no ON DELETE). Their chunks cascade;
- idempotency keys (store/idempotency.py) stored before the cutoff, first: a row deleted here
  finished before the cutoff, so the key that created it is older still, and it goes before the
  row, so a retry never finds a key whose jobs are gone. A key thus lasts the retention period.
Never a queued, running or cancelling job: every DELETE of jobs repeats the terminal-status
condition, which Postgres re-checks on a row a concurrent transaction changed.

Work is done in pages of `batch_size` rows, each its own short transaction, so a prune of
millions of rows never holds locks or a snapshot for long; an interrupted prune is simply
resumed by the next one. Files are paged by FILE_PAGE_SIZE: one file row may hold megabytes.

On Postgres the status counts of /metrics follow the deleted rows down; token totals and
histograms keep counting them (store/jobs/job_aggregates.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, func, or_, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.database import rowcount
from tokenloom.store.files.file_expiry import purge_expired_files
from tokenloom.store.jobs.streams import stream_key
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Batch, BatchStatus, File, IdempotencyKey, Job, utcnow

log = logging.getLogger(__name__)

TERMINAL_BATCH_STATUSES = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED)
FILE_PAGE_SIZE = 100
PRUNE_LOCK_KEY = "tokenloom:retention:prune"
PRUNE_INTERVAL_S = 3600


@dataclass(slots=True)
class PruneReport:
    jobs: int = 0  # every job deleted, its batch's included
    batches: int = 0
    files: int = 0
    stream_keys: int = 0  # stream keys that still existed (they also expire by themselves)


def prune(
    sessions: sessionmaker[Session],
    redis_client,
    older_than: timedelta,
    batch_size: int = 5000,
    *,
    now: datetime | None = None,
) -> PruneReport:
    """Delete what the retention rules above select; `redis_client` None leaves stream keys alone."""
    cutoff = (now or utcnow()) - older_than
    report = PruneReport()
    _delete_idempotency_keys(sessions, cutoff, batch_size)
    _delete_jobs(sessions, redis_client, _loose_jobs(cutoff), batch_size, report)
    for batch_id in _prunable_batch_ids(sessions, cutoff):
        _delete_jobs(sessions, redis_client, Job.batch_id == batch_id, batch_size, report)
        with sessions.begin() as session:
            report.batches += rowcount(
                session.execute(delete(Batch).where(Batch.id == batch_id, ~exists().where(Job.batch_id == batch_id)))
            )
    while deleted := _delete_file_page(sessions, cutoff):
        report.files += deleted
    return report


def count_prunable(
    sessions: sessionmaker[Session], older_than: timedelta, *, now: datetime | None = None
) -> PruneReport:
    """What `prune` would delete now (stream_keys: the jobs whose stream keys it would unlink)."""
    cutoff = (now or utcnow()) - older_than
    with sessions() as session:
        batch_ids = [batch_id for (batch_id,) in session.execute(_prunable_batches(cutoff))]
        loose = session.execute(select(func.count()).select_from(Job).where(_loose_jobs(cutoff))).scalar_one()
        batched = (
            session.execute(select(func.count()).select_from(Job).where(Job.batch_id.in_(batch_ids))).scalar_one()
            if batch_ids
            else 0
        )
        remaining_batches = select(Batch.id).where(Batch.id.not_in(batch_ids)) if batch_ids else select(Batch.id)
        files = session.execute(
            select(func.count()).select_from(File).where(_unreferenced_old_file(cutoff, remaining_batches))
        ).scalar_one()
    return PruneReport(jobs=loose + batched, batches=len(batch_ids), files=files, stream_keys=loose + batched)


def prune_if_due(sessions: sessionmaker[Session], redis_client, retention_days: float) -> threading.Thread | None:
    """At most once per PRUNE_INTERVAL_S across the cluster (a Redis SET NX EX key: the first worker
    to ask takes it), prune in a background thread, so a long prune never delays the caller (the
    worker's heartbeat, which renews leases): expired files' bytes always, and with `retention_days`
    above 0 everything older. Returns the thread, or None when not due."""
    if not redis_client.set(PRUNE_LOCK_KEY, str(uuid.uuid4()), nx=True, ex=PRUNE_INTERVAL_S):
        return None
    # Expired files (store/files/file_expiry.py) lose their bytes even where nothing else is pruned.
    older_than = timedelta(days=retention_days) if retention_days > 0 else None
    thread = threading.Thread(
        target=_prune_logged,
        args=(sessions, redis_client, older_than),
        name="tokenloom-retention",
        daemon=True,
    )
    thread.start()
    return thread


def _prune_logged(sessions: sessionmaker[Session], redis_client, older_than: timedelta | None) -> None:
    try:
        expired = purge_expired_files(sessions)
        if expired:
            log.info("retention: deleted the bytes of %d expired file(s)", expired)
        if older_than is None:
            return
        report = prune(sessions, redis_client, older_than)
    except Exception as exc:  # noqa: BLE001 - the next interval tries again
        log.warning("retention prune failed, retried within %d s: %s", PRUNE_INTERVAL_S, exc)
        return
    log.info(
        "retention: deleted %d jobs, %d batches, %d files, %d stream keys older than %s",
        report.jobs,
        report.batches,
        report.files,
        report.stream_keys,
        older_than,
    )


def _terminal_job():
    return Job.status.in_(TERMINAL_JOB_STATUSES)


def _loose_jobs(cutoff: datetime):
    return Job.batch_id.is_(None) & _terminal_job() & (Job.finished_at < cutoff)


def _prunable_batches(cutoff: datetime):
    ended = func.coalesce(Batch.completed_at, Batch.failed_at, Batch.cancelled_at)
    open_job = exists().where(Job.batch_id == Batch.id, ~_terminal_job())
    return select(Batch.id).where(Batch.status.in_(TERMINAL_BATCH_STATUSES), ended < cutoff, ~open_job)


def _prunable_batch_ids(sessions: sessionmaker[Session], cutoff: datetime) -> list[uuid.UUID]:
    with sessions() as session:
        return [batch_id for (batch_id,) in session.execute(_prunable_batches(cutoff))]


def _delete_jobs(sessions: sessionmaker[Session], redis_client, where, batch_size: int, report: PruneReport) -> None:
    """Delete the terminal jobs matching `where`, a page per transaction, and unlink their streams."""
    while True:
        page = select(Job.id).where(where, _terminal_job()).limit(batch_size)
        with sessions.begin() as session:
            job_ids = list(
                session.execute(
                    delete(Job).where(Job.id.in_(page.scalar_subquery()), _terminal_job()).returning(Job.id)
                ).scalars()
            )
        if not job_ids:
            return
        report.jobs += len(job_ids)
        if redis_client is not None:
            report.stream_keys += _unlink_streams(redis_client, job_ids)


def _unlink_streams(redis_client, job_ids: list[uuid.UUID]) -> int:
    pipe = redis_client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.unlink(stream_key(job_id))
    return sum(pipe.execute())


def _delete_idempotency_keys(sessions: sessionmaker[Session], cutoff: datetime, batch_size: int) -> None:
    while True:
        page = (
            select(IdempotencyKey.project, IdempotencyKey.idempotency_key)
            .where(IdempotencyKey.created_at < cutoff)
            .limit(batch_size)
        )
        with sessions.begin() as session:
            if not rowcount(
                session.execute(
                    delete(IdempotencyKey).where(
                        tuple_(IdempotencyKey.project, IdempotencyKey.idempotency_key).in_(page)
                    )
                )
            ):
                return


def _unreferenced_old_file(cutoff: datetime, batch_ids):
    referenced = or_(
        *(
            File.id.in_(select(column).where(Batch.id.in_(batch_ids), column.is_not(None)))
            for column in (Batch.input_file_id, Batch.output_file_id, Batch.error_file_id)
        )
    )
    return (File.created_at < cutoff) & ~referenced


def _delete_file_page(sessions: sessionmaker[Session], cutoff: datetime) -> int:
    with sessions.begin() as session:
        page = (
            select(File.id)
            .where(_unreferenced_old_file(cutoff, select(Batch.id)))
            .order_by(File.created_at)
            .limit(FILE_PAGE_SIZE)
        )
        return rowcount(session.execute(delete(File).where(File.id.in_(page.scalar_subquery()))))
