"""Claiming job rows: the conditional UPDATE that takes queued (or lease-expired) rows for a worker,
counts an attempt and gives up on rows that used theirs; and taking back rows this worker already
claimed when a commit's reply was lost. JobStore runs these inside its transactions.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Set
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobErrorCode, JobStatus, utcnow


class ClaimOutcome(str, enum.Enum):
    CLAIMED = "claimed"
    ALREADY_DONE = "already_done"  # terminal: ack the message, compute nothing
    OWNED_ELSEWHERE = "owned_elsewhere"  # a live worker holds the lease
    TOO_MANY_ATTEMPTS = "too_many_attempts"  # marked failed here
    RELEASED = "released"  # claimed, then handed back to the queue unfinished (worker shutdown)


@dataclass(slots=True)
class Claim:
    outcome: ClaimOutcome
    job: Job | None  # the row as claimed (None when it does not exist)


def adopt_own_rows(
    session: Session, worker_id: str, claimed_at: datetime, lease: datetime, skip: Set[uuid.UUID]
) -> dict[uuid.UUID, Claim]:
    """The rows running under `worker_id` that its claim stamped `claimed_at` took, leases renewed; no attempt counted."""
    adopted = session.scalars(
        update(Job)
        .where(
            Job.status == JobStatus.RUNNING,
            Job.worker_id == worker_id,
            Job.admitted_at == claimed_at,
            # Only fair claims stamp with the runner's unique stamp; a claim by id on another thread
            # stamps its own clock, which may fall in the same microsecond.
            Job.work_class == WorkClass.BATCH,
            Job.id.not_in(list(skip)),
        )
        .values(lease_expires_at=lease)
        .returning(Job)
        .execution_options(synchronize_session=False)
    ).all()
    return {job.id: Claim(ClaimOutcome.CLAIMED, job) for job in adopted}


def claim_rows(
    session: Session,
    job_ids: list[uuid.UUID],
    worker_id: str,
    lease_s: float,
    max_attempts: int,
    claimed_at: datetime | None = None,
) -> dict[uuid.UUID, Claim]:
    """A claim of these rows by id inside the caller's transaction; `claimed_at`: the claimed rows' `admitted_at` stamp."""
    now = utcnow()
    lease = now + timedelta(seconds=lease_s)
    claims: dict[uuid.UUID, Claim] = {}
    claimed = session.scalars(
        update(Job)
        .where(
            Job.id.in_(job_ids),
            or_(
                Job.status == JobStatus.QUEUED,
                (Job.status == JobStatus.RUNNING) & (Job.lease_expires_at < now),
            ),
        )
        .values(
            status=JobStatus.RUNNING,
            worker_id=worker_id,
            attempts=Job.attempts + 1,
            lease_expires_at=lease,
            admitted_at=claimed_at or now,
        )
        .returning(Job)
        .execution_options(synchronize_session=False)
    ).all()
    exhausted = [job for job in claimed if job.attempts > max_attempts]
    if exhausted:
        session.execute(
            update(Job)
            .where(Job.id.in_([job.id for job in exhausted]))
            .values(
                status=JobStatus.FAILED,
                finished_at=now,
                error_code=JobErrorCode.GAVE_UP,
                error=(
                    f"gave up after {max_attempts} attempts: the worker running this job died each time "
                    "(out of memory, or killed); check the worker logs"
                ),
            )
            .execution_options(synchronize_session=False)
        )
    for job in claimed:
        claims[job.id] = Claim(
            ClaimOutcome.TOO_MANY_ATTEMPTS if job.attempts > max_attempts else ClaimOutcome.CLAIMED, job
        )
    missing = [job_id for job_id in job_ids if job_id not in claims]
    if missing:
        found = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(missing)))}
        ours = [
            job_id for job_id, job in found.items() if job.status == JobStatus.RUNNING and job.worker_id == worker_id
        ]
        if ours:
            # Already ours: an earlier claim by this process committed but its reply was
            # lost (the connection dropped), so the retry finds the row taken. The job
            # runner never claims a job it is running (its active set), so nothing else of
            # ours runs it: take it, renew the lease, and do not count a second attempt.
            session.execute(
                update(Job)
                .where(Job.id.in_(ours))
                .values(lease_expires_at=lease)
                .execution_options(synchronize_session=False)
            )
        for job_id in missing:
            missing_job = found.get(job_id)
            if missing_job is None or missing_job.status in TERMINAL_JOB_STATUSES:
                claims[job_id] = Claim(ClaimOutcome.ALREADY_DONE, missing_job)
            elif job_id in ours:
                claims[job_id] = Claim(ClaimOutcome.CLAIMED, missing_job)
            else:
                claims[job_id] = Claim(ClaimOutcome.OWNED_ELSEWHERE, missing_job)
    return claims
