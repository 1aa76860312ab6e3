"""Aggregates of the jobs table kept by Postgres itself, so /metrics, /v1/stats and admission
read a few hundred rows instead of scanning millions.

Design (revision 0004 creates it):
- Statement-level AFTER INSERT / UPDATE / DELETE triggers on `jobs` read the statement's
  transition tables and append ONE aggregated row per key: new rows count +1, old rows -1.
  `job_count_deltas` is keyed by (model, project, status) and holds the number of jobs and
  their prompt/completion tokens; `job_histogram_deltas` is keyed by (model, work class, metric, le) and
  holds how many timing values fell in that bucket (the smallest bound >= the value, bounds
  from `job_histogram_bounds`) and their sum.
- Append-only, never UPDATE a running total: a running total is one hot row that every API and
  worker transaction would lock until it commits, serialising them. Inserts never conflict.
  The trigger runs inside the writer's transaction, so the deltas commit or roll back with the
  rows they describe and a reader's snapshot always agrees with the jobs table.
- Status counts are "rows in this state" and go down when rows are deleted; token totals and
  histograms are Prometheus counters, so deleting rows (retention) leaves them as they were.
  TRUNCATE zeroes the status counts the same way.
- Readers sum the deltas per key. When a table holds more than COMPACT_AFTER_ROWS rows beyond
  one per key, the reader compacts it in one statement:
      WITH moved AS (DELETE FROM t RETURNING *) INSERT INTO t SELECT key, sum(..) FROM moved GROUP BY key
  The sum over the table is unchanged by it, and stays right under concurrency (READ COMMITTED):
  a writer's delta committed after the DELETE's snapshot is not deleted and stays beside the
  compacted row; a second compaction running at once blocks on the rows the first deletes and,
  once the first commits, skips them (they are gone), so it moves only rows it deleted itself;
  readers see the table before or after, never half of it. If two compactions do deadlock,
  Postgres aborts one and its transaction leaves the deltas as they were; compaction is only
  tidying, so its errors are logged, never raised to a reader.

SQLite has no such triggers: there (the offline ledger, small local databases) store/jobs/job_stats.py
computes the same figures from the rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import job_count_deltas, job_histogram_deltas

log = logging.getLogger(__name__)

COMPACT_AFTER_ROWS = 1000  # rows beyond one per key; a compaction of this many takes milliseconds


@dataclass(frozen=True, slots=True)
class DeltaTable:
    table: Table
    key_columns: tuple[str, ...]
    sum_columns: tuple[str, ...]

    def compaction_sql(self) -> str:
        keys = ", ".join(self.key_columns)
        sums = ", ".join(f"sum({c})" for c in self.sum_columns)
        # Keys that sum to nothing (a model's `running` count once its jobs ended) are dropped.
        nonzero = " OR ".join(f"sum({c}) <> 0" for c in self.sum_columns)
        return (
            f"WITH moved AS (DELETE FROM {self.table.name} RETURNING *) "
            f"INSERT INTO {self.table.name} ({keys}, {', '.join(self.sum_columns)}) "
            f"SELECT {keys}, {sums} FROM moved GROUP BY {keys} HAVING {nonzero}"
        )


COUNT_DELTAS = DeltaTable(
    job_count_deltas, ("model", "project", "status"), ("num_jobs", "prompt_tokens", "completion_tokens")
)
HISTOGRAM_DELTAS = DeltaTable(
    job_histogram_deltas, ("model", "work_class", "metric", "le"), ("num_values", "value_sum")
)


def summed(sessions: sessionmaker[Session], deltas: DeltaTable) -> list[tuple[Any, ...]]:
    """One row per key: the key columns, then each sum column summed over its deltas."""
    columns = deltas.table.c
    query = select(
        *(columns[c] for c in deltas.key_columns),
        *(func.sum(columns[c]) for c in deltas.sum_columns),
        func.count().label("num_deltas"),
    ).group_by(*(columns[c] for c in deltas.key_columns))
    with sessions() as session:
        rows = session.execute(query).all()
    if sum(row.num_deltas for row in rows) > len(rows) + COMPACT_AFTER_ROWS:
        compact(sessions, deltas)
    return [row[:-1] for row in rows]


def compact(sessions: sessionmaker[Session], deltas: DeltaTable) -> None:
    """Replace the deltas by one row per key (their sums); see the module note for why this is safe."""
    try:
        with sessions.begin() as session:
            session.execute(text(deltas.compaction_sql()))
    except Exception as exc:  # noqa: BLE001 - tidying only: the next reader tries again
        log.warning("compacting %s failed, the next read retries: %s", deltas.table.name, exc)
