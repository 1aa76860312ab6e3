"""Job row transitions as conditional UPDATEs: at-least-once delivery, exactly-once effect.

Every transition names the states it may leave, so a stale attempt (a redelivered message, a
worker that lost its lease) can never overwrite a row that another attempt already finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Set
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

from sqlalchemy import cast, column, select, update, values
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.database import rowcount
from tokenloom.store.jobs.claim_rows import Claim, ClaimOutcome, adopt_own_rows, claim_rows
from tokenloom.store.jobs.fair_claim import pick_fair
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobErrorCode, JobStatus, utcnow


@dataclass(slots=True)
class JobResult:
    status: JobStatus  # succeeded | failed | cancelled
    output_text: str | None = None
    output_token_ids: list[int] | None = None
    choices: list[dict] | None = None
    # prompt_logprobs asked: their stored form (engine/outputs/compact_prompt_logprobs.py)
    prompt_logprobs: dict | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_code: JobErrorCode | None = None  # set with `error` on a failure (JobResult.failed)
    first_token_at: datetime | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def failed(cls, code: JobErrorCode, message: str) -> "JobResult":
        return cls(JobStatus.FAILED, error=message, error_code=code)


class JobRef(NamedTuple):
    """What it takes to send a job's message again: its id, and its model's queue for its class."""

    id: uuid.UUID
    model: str
    work_class: WorkClass


_REF_COLUMNS = (Job.id, Job.model, Job.work_class)


class JobStore:
    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def get(self, job_id: uuid.UUID) -> Job | None:
        with self.sessions() as session:
            return session.get(Job, job_id)

    def claim(self, job_id: uuid.UUID, worker_id: str, lease_s: float, max_attempts: int) -> "ClaimOutcome":
        """queued (or running with an expired lease) -> running, owned by `worker_id`."""
        return self.claim_many([job_id], worker_id, lease_s, max_attempts)[job_id].outcome

    def claim_many(
        self, job_ids: list[uuid.UUID], worker_id: str, lease_s: float, max_attempts: int
    ) -> dict[uuid.UUID, "Claim"]:
        """Claim a group of jobs in one transaction: one conditional UPDATE ... RETURNING for all.

        Each row keeps its own lease and attempt count; the condition is per row, so a group may
        come back partly claimed (some rows done, some owned by a live worker elsewhere).
        """
        with self.sessions.begin() as session:
            return claim_rows(session, job_ids, worker_id, lease_s, max_attempts)

    def claim_fair(
        self,
        hint: list[uuid.UUID],
        worker_id: str,
        lease_s: float,
        max_attempts: int,
        skip: Set[uuid.UUID] = frozenset(),
        *,
        claimed_at: datetime | None = None,
        adopt: bool = False,
    ) -> dict[uuid.UUID, "Claim"]:
        """Claim as many batch lines as the message `hint` names, chosen fairly (store/jobs/fair_claim.py).

        A hinted row whose worker died (running, lease expired) is claimed itself, unless it is in
        `skip` (running here); the rest of the count goes to the model's queued batch lines of the
        projects holding the fewest running lines. A hinted line left queued is taken by a later
        message: each batch message claims its count, so the messages cover every line.

        `claimed_at` stamps the rows claimed (their `admitted_at`; the caller makes it unique per
        claim of its worker). With `adopt`, a retry of the same claim first takes back the rows this
        worker already owns under that stamp: an earlier try committed but its reply was lost, and a
        retry would otherwise pick other lines and leave those running untracked, unrenewed, until
        their leases expired and an attempt was charged. They count against the hint, keep their
        attempt, and get a fresh lease.
        """
        now = utcnow()
        with self.sessions.begin() as session:
            adopted: dict[uuid.UUID, Claim] = {}
            if adopt and claimed_at is not None:
                adopted = adopt_own_rows(session, worker_id, claimed_at, now + timedelta(seconds=lease_s), skip)
            rows = session.execute(
                select(Job.id, Job.model, Job.status, Job.lease_expires_at).where(Job.id.in_(hint))
            ).all()
            if not rows:
                return adopted
            orphans = [
                row.id
                for row in rows
                if row.status == JobStatus.RUNNING
                and row.id not in skip
                and row.id not in adopted
                and row.lease_expires_at is not None
                and _aware(row.lease_expires_at) < now
            ]
            wanted = len(hint) - len(orphans) - len(adopted)
            picked = pick_fair(session, rows[0].model, wanted) if wanted > 0 else []
            claims = claim_rows(session, picked + orphans, worker_id, lease_s, max_attempts, claimed_at)
            return {**claims, **adopted}

    def claim_fair_count(
        self,
        model: str,
        count: int,
        worker_id: str,
        lease_s: float,
        max_attempts: int,
        *,
        claimed_at: datetime | None = None,
        adopt: bool = False,
    ) -> dict[uuid.UUID, "Claim"]:
        """Claim up to `count` of `model`'s queued batch lines, chosen fairly, without a message: a
        worker's guaranteed share of batch lines when their messages wait behind jobs' at Redis
        (worker/owed_batch_claims.py). `claimed_at` and `adopt` as for `claim_fair`."""
        with self.sessions.begin() as session:
            adopted: dict[uuid.UUID, Claim] = {}
            if adopt and claimed_at is not None:
                adopted = adopt_own_rows(
                    session, worker_id, claimed_at, utcnow() + timedelta(seconds=lease_s), frozenset()
                )
            wanted = count - len(adopted)
            picked = pick_fair(session, model, wanted) if wanted > 0 else []
            claims = claim_rows(session, picked, worker_id, lease_s, max_attempts, claimed_at)
            return {**claims, **adopted}

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
        return job_id in self.finish_many(worker_id, [(job_id, result)])

    def finish_many(self, worker_id: str, results: list[tuple[uuid.UUID, JobResult]]) -> set[uuid.UUID]:
        """Write many outcomes in one statement; returns the ids whose rows took their result.

        Each row is written only if it is still running (or cancelling) under `worker_id`, so a
        stale attempt never overwrites a result. On Postgres it is one UPDATE ... FROM (VALUES
        ...) RETURNING: one round trip for a whole step's finished jobs.
        """
        if not results:
            return set()
        now = utcnow()
        rows = [_result_row(job_id, result, now) for job_id, result in results]
        with self.sessions.begin() as session:
            if session.get_bind().dialect.name != "postgresql":  # SQLite has no VALUES column aliases
                written = set()
                for row in rows:
                    job_id = row.pop("id")
                    if rowcount(
                        session.execute(
                            update(Job)
                            .where(Job.id == job_id, *_owned_by(worker_id))
                            .values(**row, lease_expires_at=None)
                            .execution_options(synchronize_session=False)
                        )
                    ):
                        written.add(job_id)
                return written
            table = Job.__table__
            incoming = values(*(column(name, table.c[name].type) for name in _RESULT_COLUMNS), name="incoming").data(
                [tuple(row[name] for name in _RESULT_COLUMNS) for row in rows]
            )
            return set(
                session.scalars(
                    update(Job)
                    .where(Job.id == incoming.c.id, *_owned_by(worker_id))
                    # The casts type the columns that are NULL in every row (Postgres would read text).
                    .values(
                        {name: cast(incoming.c[name], table.c[name].type) for name in _RESULT_COLUMNS if name != "id"}
                        | {"lease_expires_at": None}
                    )
                    .returning(Job.id)
                    .execution_options(synchronize_session=False)
                )
            )

    def request_cancel(self, job_ids: list[uuid.UUID]) -> tuple[int, int]:
        """Cancel jobs in one transaction: queued -> cancelled at once, running -> cancelling.

        A cancelling job is aborted by the worker that runs it (its CancelWatcher polls
        `cancel_requested_among`), which then records it cancelled with its partial output. Terminal
        rows are untouched. Returns (number cancelled now, number now cancelling).
        """
        if not job_ids:
            return 0, 0
        now = utcnow()
        with self.sessions.begin() as session:
            cancelled = rowcount(
                session.execute(
                    update(Job)
                    .where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED)
                    .values(
                        status=JobStatus.CANCELLED,
                        finished_at=now,
                        error="cancelled before it started",
                        error_code=JobErrorCode.CANCELLED,
                    )
                )
            )
            cancelling = rowcount(
                session.execute(
                    update(Job)
                    .where(Job.id.in_(job_ids), Job.status == JobStatus.RUNNING)
                    .values(status=JobStatus.CANCELLING)
                )
            )
        return cancelled, cancelling

    def finish_orphaned_cancels(self) -> int:
        """cancelling jobs whose worker died (lease expired) -> cancelled; they are never re-run.

        Leases of cancelling jobs are not renewed, but a live worker aborts within a cancel poll
        (0.5 s), far inside the >= 2/3 of a lease left since its last heartbeat.
        """
        with self.sessions.begin() as session:
            return rowcount(
                session.execute(
                    update(Job)
                    .where(Job.status == JobStatus.CANCELLING, Job.lease_expires_at < utcnow())
                    .values(
                        status=JobStatus.CANCELLED,
                        finished_at=utcnow(),
                        lease_expires_at=None,
                        error_code=JobErrorCode.CANCELLED,
                        error="cancelled; its worker stopped before recording the partial output",
                    )
                )
            )

    def cancel_requested_among(self, job_ids: list[uuid.UUID]) -> set[uuid.UUID]:
        """Which of these jobs are cancelling: one query for every job a worker runs."""
        if not job_ids:
            return set()
        with self.sessions() as session:
            return set(
                session.execute(select(Job.id).where(Job.id.in_(job_ids), Job.status == JobStatus.CANCELLING)).scalars()
            )

    def release(self, job_id: uuid.UUID, worker_id: str) -> bool:
        """running -> queued: hand a job back unfinished (graceful shutdown), not counted as an attempt."""
        return job_id in self.release_many([job_id], worker_id)

    def release_many(self, job_ids: list[uuid.UUID], worker_id: str) -> set[uuid.UUID]:
        """running -> queued for the jobs of ours still running; returns the ids that moved.

        Only the owning worker's running rows move; a row that became cancelling meanwhile stays
        with its owner, which records it cancelled.
        """
        if not job_ids:
            return set()
        with self.sessions.begin() as session:
            return set(
                session.scalars(
                    update(Job)
                    .where(Job.id.in_(job_ids), Job.worker_id == worker_id, Job.status == JobStatus.RUNNING)
                    .values(
                        status=JobStatus.QUEUED,
                        worker_id=None,
                        lease_expires_at=None,
                        admitted_at=None,
                        attempts=Job.attempts - 1,
                    )
                    .returning(Job.id)
                    .execution_options(synchronize_session=False)
                )
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

    def expired_running_jobs(self, limit: int = 100, *, work_class: WorkClass | None = None) -> list[JobRef]:
        """Running jobs whose worker stopped renewing its lease (it died): to be sent again.
        `work_class`: only that class's (the reconciler asks per class, so no class's orphans hide another's)."""
        query = select(*_REF_COLUMNS).where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < utcnow())
        if work_class is not None:
            query = query.where(Job.work_class == work_class)
        return self._refs(query.limit(limit))

    def stale_queued_jobs(
        self, older_than_s: float, limit: int = 100, *, model: str | None = None, work_class: WorkClass | None = None
    ) -> list[JobRef]:
        """Jobs still queued `older_than_s` after they were created, oldest first. With `model` and
        `work_class` (the reconciler's per-class sweep), only theirs, read through ix_jobs_fair_claim:
        a class's jobs are found whatever other classes hold queued."""
        cutoff = utcnow() - timedelta(seconds=older_than_s)
        query = select(*_REF_COLUMNS).where(Job.status == JobStatus.QUEUED, Job.created_at < cutoff)
        if model is not None:
            query = query.where(Job.model == model)
        if work_class is not None:
            query = query.where(Job.work_class == work_class)
        return self._refs(query.order_by(Job.created_at).limit(limit))

    def queued_jobs(self, after: uuid.UUID | None = None, limit: int = 1000) -> list[JobRef]:
        """Queued jobs in id order, a page at a time (keyset pagination from `after`)."""
        query = select(*_REF_COLUMNS).where(Job.status == JobStatus.QUEUED).order_by(Job.id).limit(limit)
        if after is not None:
            query = query.where(Job.id > after)
        return self._refs(query)

    def _refs(self, query) -> list[JobRef]:
        with self.sessions() as session:
            return [JobRef(row.id, row.model, row.work_class) for row in session.execute(query)]


def _aware(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; they were stored in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


_RESULT_COLUMNS = (
    "id",
    "status",
    "output_text",
    "output_token_ids",
    "choices",
    "prompt_logprobs",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
    "error_code",
    "first_token_at",
    "finished_at",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
)


def _owned_by(worker_id: str) -> tuple:
    return Job.worker_id == worker_id, Job.status.in_([JobStatus.RUNNING, JobStatus.CANCELLING])


def _result_row(job_id: uuid.UUID, result: JobResult, now: datetime) -> dict:
    return {
        "id": job_id,
        "status": result.status,
        "output_text": _text_column(result.output_text),
        "output_token_ids": result.output_token_ids,
        "choices": result.choices,
        "prompt_logprobs": result.prompt_logprobs,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "finish_reason": result.finish_reason,
        "error": _text_column(result.error),
        # A cancelled job's row says so whichever path recorded it (its partial output may follow).
        "error_code": result.error_code or (JobErrorCode.CANCELLED if result.status is JobStatus.CANCELLED else None),
        "first_token_at": result.first_token_at,
        "finished_at": now,
        "queue_s": result.queue_s,
        "ttft_s": result.ttft_s,
        "tpot_s": result.tpot_s,
        "e2e_s": result.e2e_s,
    }


def _text_column(text: str | None) -> str | None:
    # Postgres text cannot hold NUL characters, which models do emit. The exact text stays in the
    # `choices` JSON column (JSON escapes NUL as \u0000), which every reader uses; this column is
    # for humans and SQL queries.
    return None if text is None else text.replace("\x00", "\ufffd")
