"""Batch rows for online callers (OpenAI Batches API): fetch one, list a page, live counts.

`project=None` means every project (the admin). Batches that `tokenloom run` keeps as its resume
ledger (run_key set) are an offline run's bookkeeping, not queue batches: the API never shows them.
Request counts and token usage come from trigger-kept deltas (store/batches/batch_counters.py), so
they move while a batch runs and cost the same at any size; the finalizer writes the same counts
into the row at the end.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.batches.batch_counters import summed_batch_deltas
from tokenloom.store.jobs.job_stats import sum_or_zero
from tokenloom.store.models import Batch, Job, JobStatus
from tokenloom.store.pagination import Page, page_after


@dataclass(slots=True)
class BatchCounts:
    total: int = 0
    completed: int = 0  # succeeded jobs (OpenAI's "completed" requests)
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


def _visible(query, project: str | None):
    query = query.where(Batch.run_key.is_(None))
    return query if project is None else query.where(Batch.project == project)


def visible_batch(sessions: sessionmaker[Session], batch_id: uuid.UUID, project: str | None) -> Batch | None:
    with sessions() as session:
        return session.execute(_visible(select(Batch), project).where(Batch.id == batch_id)).scalar_one_or_none()


def list_batches(
    sessions: sessionmaker[Session],
    project: str | None,
    *,
    limit: int = 20,
    after: uuid.UUID | None = None,
) -> Page:
    """Newest first; `after` is the last id of the previous page. LookupError for an unknown cursor."""
    with sessions() as session:
        cursor = None
        if after is not None:
            cursor = session.execute(_visible(select(Batch), project).where(Batch.id == after)).scalar_one_or_none()
            if cursor is None:
                raise LookupError(f"after={after}: no such batch")
        return page_after(session, _visible(select(Batch), project), Batch, cursor, limit)


def batch_counts(sessions: sessionmaker[Session], batch_ids: list[uuid.UUID]) -> dict[uuid.UUID, BatchCounts]:
    """Per batch: jobs in total, succeeded, failed, and the tokens they consumed and produced. On
    Postgres from the trigger-kept deltas (store/batches/batch_counters.py: a few rows however large
    the batch), elsewhere (and for batches older than revision 0011) from the rows."""
    counts = {batch_id: BatchCounts() for batch_id in batch_ids}
    if not batch_ids:
        return counts
    with sessions() as session:
        on_postgres = session.get_bind().dialect.name == "postgresql"
        # Batches made before revision 0011 have no deltas: theirs are summed from the rows.
        by_triggers = (
            set(session.scalars(select(Batch.id).where(Batch.id.in_(batch_ids), Batch.counted_by_triggers)))
            if on_postgres
            else set()
        )
    by_rows = [batch_id for batch_id in batch_ids if batch_id not in by_triggers]
    rows = summed_batch_deltas(sessions, list(by_triggers)) if by_triggers else []
    rows += _summed_rows(sessions, by_rows) if by_rows else []
    for batch_id, status, number, prompt_tokens, completion_tokens in rows:
        c = counts[batch_id]
        c.total += number
        c.completed += number if status == JobStatus.SUCCEEDED.value else 0
        c.failed += number if status == JobStatus.FAILED.value else 0
        c.input_tokens += prompt_tokens
        c.output_tokens += completion_tokens
    return counts


def _summed_rows(sessions: sessionmaker[Session], batch_ids: list[uuid.UUID]) -> list[tuple]:
    query = (
        select(
            Job.batch_id, Job.status, func.count(), sum_or_zero(Job.prompt_tokens), sum_or_zero(Job.completion_tokens)
        )
        .where(Job.batch_id.in_(batch_ids))
        .group_by(Job.batch_id, Job.status)
    )
    with sessions() as session:
        return [
            (batch_id, status.value, number, int(prompt_tokens), int(completion_tokens))
            for batch_id, status, number, prompt_tokens, completion_tokens in session.execute(query)
        ]
