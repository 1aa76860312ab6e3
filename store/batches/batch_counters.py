"""A batch's request counts and token usage, read in the same time at 10 lines as at 1,000,000.

On Postgres, triggers on `jobs` (revision 0011) append a delta per (batch, status) with every
statement that inserts, changes or deletes a batch's lines; a batch's figures are the sums of its
deltas. A batch that has run long holds many (a few per claim and per recorded group of lines), so
a reader that finds more than COMPACT_AFTER_ROWS beyond one per key replaces them by their sums, in
one statement, as store/jobs/job_aggregates.py does for the model aggregates (its module note says
why that is safe under concurrent writers). SQLite has no triggers: there the figures are summed
from the rows, as before.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import batch_count_deltas

log = logging.getLogger(__name__)

COMPACT_AFTER_ROWS = 200  # deltas beyond one per (batch, status) before a reader folds them

_COMPACTION = text(
    "WITH moved AS (DELETE FROM batch_count_deltas WHERE batch_id = ANY(:batch_ids) RETURNING *) "
    "INSERT INTO batch_count_deltas (batch_id, status, num_jobs, prompt_tokens, completion_tokens) "
    "SELECT batch_id, status, sum(num_jobs), sum(prompt_tokens), sum(completion_tokens) FROM moved "
    "GROUP BY batch_id, status HAVING sum(num_jobs) <> 0 OR sum(prompt_tokens) <> 0 OR sum(completion_tokens) <> 0"
).bindparams(bindparam("batch_ids", expanding=False))


def summed_batch_deltas(
    sessions: sessionmaker[Session], batch_ids: list[uuid.UUID]
) -> list[tuple[uuid.UUID, str, int, int, int]]:
    """(batch, status, lines, prompt tokens, completion tokens) summed over the batches' deltas."""
    columns = batch_count_deltas.c
    query = (
        select(
            columns.batch_id,
            columns.status,
            func.sum(columns.num_jobs),
            func.sum(columns.prompt_tokens),
            func.sum(columns.completion_tokens),
            func.count().label("num_deltas"),
        )
        .where(columns.batch_id.in_(batch_ids))
        .group_by(columns.batch_id, columns.status)
    )
    with sessions() as session:
        rows = session.execute(query).all()
    if sum(row.num_deltas for row in rows) > len(rows) + COMPACT_AFTER_ROWS:
        compact(sessions, {row.batch_id for row in rows})
    # A status the batch's lines have all left sums to zero until a fold drops it.
    return [(row[0], row[1], int(row[2]), int(row[3]), int(row[4])) for row in rows if any(row[2:5])]


def compact(sessions: sessionmaker[Session], batch_ids: Iterable[uuid.UUID]) -> None:
    """Fold these batches' deltas into one row per status (their sums); tidying only, never raised."""
    try:
        with sessions.begin() as session:
            session.execute(_COMPACTION, {"batch_ids": list(batch_ids)})
    except Exception as exc:  # noqa: BLE001 - the next reader tries again
        log.warning("compacting batch_count_deltas failed, the next read retries: %s", exc)
