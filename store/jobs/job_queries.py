"""Job rows for online callers (the REST API): enqueue, fetch one, list a page; scoped by project.

`project=None` means every project (the admin). Rows are inserted before any message is sent,
as in job_service.submit_file, so a worker never receives an id it cannot find.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from celery import Celery
from sqlalchemy import select, update
from sqlalchemy.orm import Session, defer, sessionmaker

from tokenloom.store.celery_app import send_job
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobErrorCode, JobStatus, utcnow
from tokenloom.store.pagination import page_after


class QueueUnavailableError(RuntimeError):
    """The rows were written but their messages could not be sent; they were marked failed."""


# What a list page leaves unread: a scoring job's prompt logprobs are up to [server]
# max_prompt_logprob_entries entries (hundreds of MB as objects) and its prompt up to max_model_len
# tokens, so a page of 1,000 such rows would hold them all; a page shows none of them.
LIST_PAGE_DEFERRED = tuple(
    defer(column, raiseload=True) for column in (Job.prompt_logprobs, Job.prompt_token_ids, Job.prompt, Job.messages)
)


@dataclass(slots=True)
class JobPage:
    jobs: list[Job]
    has_more: bool


def enqueue_jobs(sessions: sessionmaker[Session], app: Celery, jobs: list[Job]) -> list[Job]:
    """Insert queued rows in one transaction, then send one message per row to its model's queue."""
    with sessions.begin() as session:
        session.add_all(jobs)
    return send_queued(sessions, app, jobs)


def send_queued(sessions: sessionmaker[Session], app: Celery, jobs: list[Job]) -> list[Job]:
    """One message per inserted, queued row; QueueUnavailableError when the broker is down."""
    for sent, job in enumerate(jobs):
        try:
            # A row built without a class gets the column's server default, jobs: send it there.
            send_job(app, job.id, job.model, job.work_class or WorkClass.JOBS)
        except Exception as exc:  # broker down: fail the unsent rows rather than leave them queued forever
            _fail_unsent(sessions, [j.id for j in jobs[sent:]], exc)
            raise QueueUnavailableError(f"the job queue (Redis) is unreachable: {exc}") from exc
    return jobs


def _fail_unsent(sessions: sessionmaker[Session], job_ids: list[uuid.UUID], exc: Exception) -> None:
    with sessions.begin() as session:
        session.execute(
            update(Job)
            .where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED)
            .values(
                status=JobStatus.FAILED,
                finished_at=utcnow(),
                error_code=JobErrorCode.QUEUE_UNAVAILABLE,
                error=f"could not be queued, the job queue (Redis) was unreachable: {exc}",
            )
        )


def visible_job(sessions: sessionmaker[Session], job_id: uuid.UUID, project: str | None) -> Job | None:
    """The row if it exists and `project` may see it (None = any project), else None."""
    with sessions() as session:
        job = session.get(Job, job_id)
    if job is None or (project is not None and job.project != project):
        return None
    return job


def list_jobs(
    sessions: sessionmaker[Session],
    project: str | None,
    *,
    status: JobStatus | None = None,
    batch_id: uuid.UUID | None = None,
    limit: int = 20,
    after: uuid.UUID | None = None,
) -> JobPage:
    """Newest first; `after` is the last id of the previous page (OpenAI's cursor convention).
    Keyset pages (store/pagination.py): a deep page costs what the first one does. The rows come
    without their prompts and prompt logprobs (LIST_PAGE_DEFERRED): reading one raises."""
    query = select(Job).options(*LIST_PAGE_DEFERRED)
    if project is not None:
        query = query.where(Job.project == project)
    if status is not None:
        query = query.where(Job.status == status)
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    with sessions() as session:
        cursor = None
        if after is not None:
            cursor = session.get(Job, after, options=LIST_PAGE_DEFERRED)
            if cursor is None or (project is not None and cursor.project != project):
                raise LookupError(f"after={after}: no such job")
        page = page_after(session, query, Job, cursor, limit)
    return JobPage(page.rows, page.has_more)
