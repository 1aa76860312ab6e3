"""Job row transitions as conditional UPDATEs: at-least-once delivery, exactly-once effect.

Every transition names the states it may leave, so a stale attempt (a redelivered message, a
worker that lost its lease) can never overwrite a row that another attempt already finished.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobStatus, utcnow


@dataclass(slots=True)
class JobResult:
    status: JobStatus  # succeeded | failed | cancelled
    output_text: str | None = None
    output_token_ids: list[int] | None = None
    choices: list[dict] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: datetime | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


class ClaimOutcome(str, enum.Enum):
    CLAIMED = "claimed"
    ALREADY_DONE = "already_done"  # terminal: ack the message, compute nothing
    OWNED_ELSEWHERE = "owned_elsewhere"  # a live worker holds the lease
    TOO_MANY_ATTEMPTS = "too_many_attempts"  # marked failed here
    RELEASED = "released"  # claimed, then handed back to the queue unfinished (worker shutdown)


class JobStore:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def get(self, job_id: uuid.UUID) -> Job | None:
        with self.sessions() as session:
            return session.get(Job, job_id)

    def claim(self, job_id: uuid.UUID, worker_id: str, lease_s: float, max_attempts: int) -> "ClaimOutcome":
        """queued (or running with an expired lease) -> running, owned by `worker_id`."""
        now = utcnow()
        with self.sessions.begin() as session:
            claimed = session.execute(
                update(Job)
                .where(
                    Job.id == job_id,
                    or_(
                        Job.status == JobStatus.QUEUED,
                        (Job.status == JobStatus.RUNNING) & (Job.lease_expires_at < now),
                    ),
                )
                .values(
                    status=JobStatus.RUNNING, worker_id=worker_id, attempts=Job.attempts + 1,
                    lease_expires_at=now + timedelta(seconds=lease_s), admitted_at=now,
                )
            ).rowcount
            job = session.get(Job, job_id)
            if job is None or (not claimed and job.status in TERMINAL_JOB_STATUSES):
                return ClaimOutcome.ALREADY_DONE
            if not claimed and job.status == JobStatus.RUNNING and job.worker_id == worker_id:
                # Already ours: an earlier claim by this process committed but its reply was lost
                # (the connection dropped), so the retry finds the row taken. The job runner never
                # claims a job it is running (its active set), so nothing else of ours runs it:
                # take it, renew the lease, and do not count a second attempt.
                job.lease_expires_at = now + timedelta(seconds=lease_s)
                return ClaimOutcome.CLAIMED
            if not claimed:
                return ClaimOutcome.OWNED_ELSEWHERE
            if job.attempts > max_attempts:
                job.status = JobStatus.FAILED
                job.error = (
                    f"gave up after {max_attempts} attempts: the worker running this job died each time "
                    "(out of memory, or killed); check the worker logs"
                )
                job.finished_at = now
                return ClaimOutcome.TOO_MANY_ATTEMPTS
            return ClaimOutcome.CLAIMED

    def renew_leases(self, job_ids: list[uuid.UUID], worker_id: str, lease_s: float) -> None:
        if not job_ids:
            return
        with self.sessions.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id.in_(job_ids), Job.worker_id == worker_id, Job.status == JobStatus.RUNNING)
                .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            )

    def finish(self, job_id: uuid.UUID, worker_id: str, result: JobResult) -> bool:
        """Write the outcome unless the row already ended or belongs to another attempt."""
        with self.sessions.begin() as session:
            return bool(
                session.execute(
                    update(Job)
                    .where(
                        Job.id == job_id,
                        Job.worker_id == worker_id,
                        Job.status.in_([JobStatus.RUNNING, JobStatus.CANCELLING]),
                    )
                    .values(
                        status=result.status, output_text=_text_column(result.output_text),
                        output_token_ids=result.output_token_ids, choices=result.choices,
                        prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                        finish_reason=result.finish_reason, error=_text_column(result.error),
                        first_token_at=result.first_token_at, finished_at=utcnow(), queue_s=result.queue_s,
                        ttft_s=result.ttft_s, tpot_s=result.tpot_s, lease_expires_at=None,
                    )
                ).rowcount
            )

    def request_cancel(self, job_ids: list[uuid.UUID]) -> tuple[int, int]:
        """Cancel jobs in one transaction: queued -> cancelled at once, running -> cancelling.

        A cancelling job is aborted by the worker that runs it (JobRunner polls
        `cancel_requested_among`), which then records it cancelled with its partial output. Terminal
        rows are untouched. Returns (number cancelled now, number now cancelling).
        """
        if not job_ids:
            return 0, 0
        now = utcnow()
        with self.sessions.begin() as session:
            cancelled = session.execute(
                update(Job)
                .where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED)
                .values(status=JobStatus.CANCELLED, finished_at=now, error="cancelled before it started")
            ).rowcount
            cancelling = session.execute(
                update(Job)
                .where(Job.id.in_(job_ids), Job.status == JobStatus.RUNNING)
                .values(status=JobStatus.CANCELLING)
            ).rowcount
        return cancelled, cancelling

    def finish_orphaned_cancels(self) -> int:
        """cancelling jobs whose worker died (lease expired) -> cancelled; they are never re-run.

        Leases of cancelling jobs are not renewed, but a live worker aborts within a cancel poll
        (0.5 s), far inside the >= 2/3 of a lease left since its last heartbeat.
        """
        with self.sessions.begin() as session:
            return session.execute(
                update(Job)
                .where(Job.status == JobStatus.CANCELLING, Job.lease_expires_at < utcnow())
                .values(
                    status=JobStatus.CANCELLED, finished_at=utcnow(), lease_expires_at=None,
                    error="cancelled; its worker stopped before recording the partial output",
                )
            ).rowcount

    def cancel_requested_among(self, job_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        """Which of these jobs are cancelling: one query for every job a worker runs."""
        if not job_ids:
            return set()
        with self.sessions() as session:
            return set(session.execute(
                select(Job.id).where(Job.id.in_(job_ids), Job.status == JobStatus.CANCELLING)
            ).scalars())

    def release(self, job_id: uuid.UUID, worker_id: str) -> bool:
        """running -> queued: hand a job back unfinished (graceful shutdown), not counted as an attempt.

        Only the owning worker's running row moves; a row that became cancelling meanwhile stays
        with its owner, which records it cancelled.
        """
        with self.sessions.begin() as session:
            return bool(
                session.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == JobStatus.RUNNING)
                    .values(status=JobStatus.QUEUED, worker_id=None, lease_expires_at=None, admitted_at=None,
                            attempts=Job.attempts - 1)
                ).rowcount
            )

    def mark_orphaned(self, job_id: uuid.UUID, worker_id: str) -> None:
        """queued/running -> running with an expired lease: the reconciler of any worker re-sends it.

        The fallback when a job handed back to the queue could not be sent (Redis unreachable).
        """
        with self.sessions.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
                .values(status=JobStatus.RUNNING, worker_id=worker_id, lease_expires_at=utcnow() - timedelta(seconds=1))
            )

    def expired_running_jobs(self, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
        """(id, model) of running jobs whose worker stopped renewing its lease (it died): to be sent again."""
        with self.sessions() as session:
            return [
                (row.id, row.model)
                for row in session.execute(
                    select(Job.id, Job.model)
                    .where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < utcnow())
                    .limit(limit)
                )
            ]

    def stale_queued_jobs(self, older_than_s: float, limit: int = 100) -> list[tuple[uuid.UUID, str]]:
        """(id, model) of jobs still queued `older_than_s` after they were created, oldest first."""
        cutoff = utcnow() - timedelta(seconds=older_than_s)
        query = (select(Job.id, Job.model).where(Job.status == JobStatus.QUEUED, Job.created_at < cutoff)
                 .order_by(Job.created_at).limit(limit))
        with self.sessions() as session:
            return [(row.id, row.model) for row in session.execute(query)]

    def queued_jobs(self, after: uuid.UUID | None = None, limit: int = 1000) -> list[tuple[uuid.UUID, str]]:
        """(id, model) of queued jobs in id order, a page at a time (keyset pagination from `after`)."""
        query = select(Job.id, Job.model).where(Job.status == JobStatus.QUEUED).order_by(Job.id).limit(limit)
        if after is not None:
            query = query.where(Job.id > after)
        with self.sessions() as session:
            return [(row.id, row.model) for row in session.execute(query)]


def _text_column(text: str | None) -> str | None:
    # Postgres text cannot hold NUL characters, which models do emit. The exact text stays in the
    # `choices` JSON column (JSON escapes NUL as \u0000), which every reader uses; this column is
    # for humans and SQL queries.
    return None if text is None else text.replace("\x00", "\ufffd")
