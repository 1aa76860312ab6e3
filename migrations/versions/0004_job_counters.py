"""Incremental job aggregates for /metrics, /v1/stats and admission (no scans of the jobs table),
and the indexes behind the stats window, retention and the admin's job, batch and file listings.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04

On Postgres, statement-level triggers on `jobs` append one aggregated row per key per statement
to `job_count_deltas` and `job_histogram_deltas` (store/jobs/job_aggregates.py explains the design),
and the existing rows are summed into them here. The triggers are created before the backfill:
CREATE TRIGGER locks `jobs` against writers until this transaction commits, so no write lands
between the backfill's snapshot and the triggers taking over.

SQLite (the offline ledger's default) gets the same tables, left empty, and no triggers:
store/jobs/job_stats.py computes its figures from the rows there.

The histogram bounds are copied here, not imported: a migration must create the same rows
whenever it runs. tests/api/test_job_aggregates.py checks they equal store/jobs/job_stats.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HISTOGRAM_BOUNDS = {
    "ttft_s": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
    "tpot_s": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    "queue_s": (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0),
}


def _count_rows(source: str, sign: str) -> str:
    """(model, project, status) -> jobs and tokens of `source`, each row weighted by `sign`."""
    return f"""
    SELECT model, project, status, sum({sign}), coalesce(sum({sign} * prompt_tokens), 0),
           coalesce(sum({sign} * completion_tokens), 0)
    FROM {source} GROUP BY model, project, status"""


def _histogram_rows(source: str, sign: str) -> str:
    """(model, metric, bucket) -> values and their sum in `source`, each row weighted by `sign`.
    A value's bucket is the smallest bound >= it ('Infinity' catches the rest, NaN included)."""
    values = " UNION ALL ".join(
        f"SELECT model, '{metric}' AS metric, {metric} AS value, {sign} AS sign FROM {source} "
        f"WHERE {metric} IS NOT NULL"
        for metric in HISTOGRAM_BOUNDS
    )
    return f"""
    SELECT v.model, v.metric, b.le, sum(v.sign), sum(v.sign * v.value)
    FROM ({values}) v
    CROSS JOIN LATERAL (SELECT coalesce(min(le), 'Infinity') AS le FROM job_histogram_bounds
                        WHERE metric = v.metric AND le >= v.value) b
    GROUP BY v.model, v.metric, b.le"""


COUNT_COLUMNS = "(model, project, status, num_jobs, prompt_tokens, completion_tokens)"
HISTOGRAM_COLUMNS = "(model, metric, le, num_values, value_sum)"

# One function per event: a statement-level trigger sees only the transition tables its event has.
TRIGGER_FUNCTIONS = {
    "INSERT": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS} {_count_rows("new_jobs", "1")};
        INSERT INTO job_histogram_deltas {HISTOGRAM_COLUMNS} {_histogram_rows("new_jobs", "1")};""",
    # New rows count +1, old rows -1; keys whose changes cancel (a lease renewal) add no row.
    "UPDATE": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS}
        SELECT model, project, status, sum(n), sum(p), sum(c) FROM (
            {_count_rows("new_jobs", "1")} UNION ALL {_count_rows("old_jobs", "-1")}
        ) changes (model, project, status, n, p, c)
        GROUP BY model, project, status HAVING sum(n) <> 0 OR sum(p) <> 0 OR sum(c) <> 0;
        INSERT INTO job_histogram_deltas {HISTOGRAM_COLUMNS}
        SELECT model, metric, le, sum(n), sum(s) FROM (
            {_histogram_rows("new_jobs", "1")} UNION ALL {_histogram_rows("old_jobs", "-1")}
        ) changes (model, metric, le, n, s)
        GROUP BY model, metric, le HAVING sum(n) <> 0 OR sum(s) <> 0;""",
    # Status counts are rows in a state; tokens and histograms are counters a prune must not lower.
    "DELETE": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS}
        SELECT model, project, status, -count(*), 0, 0 FROM old_jobs GROUP BY model, project, status;""",
    "TRUNCATE": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS}
        SELECT model, project, status, -sum(num_jobs), 0, 0 FROM job_count_deltas
        GROUP BY model, project, status HAVING sum(num_jobs) <> 0;""",
}
TRANSITION_TABLES = {
    "INSERT": "REFERENCING NEW TABLE AS new_jobs",
    "UPDATE": "REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs",
    "DELETE": "REFERENCING OLD TABLE AS old_jobs",
    "TRUNCATE": "",  # TRUNCATE has no transition tables
}


def _name(event: str) -> str:
    return f"jobs_aggregates_on_{event.lower()}"


def upgrade() -> None:
    op.create_table(
        "job_count_deltas",
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("num_jobs", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "job_histogram_deltas",
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("metric", sa.String(length=16), nullable=False),
        sa.Column("le", sa.Float(), nullable=False),
        sa.Column("num_values", sa.BigInteger(), nullable=False),
        sa.Column("value_sum", sa.Float(), nullable=False),
    )
    bounds = op.create_table(
        "job_histogram_bounds",
        sa.Column("metric", sa.String(length=16), nullable=False),
        sa.Column("le", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("metric", "le"),
    )
    op.bulk_insert(
        bounds,
        [{"metric": metric, "le": le} for metric, les in HISTOGRAM_BOUNDS.items() for le in (*les, float("inf"))],
    )
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.create_index("ix_jobs_created_at_id", "jobs", ["created_at", "id"])
    op.create_index("ix_batches_created_at_id", "batches", ["created_at", "id"])
    op.create_index("ix_files_created_at_id", "files", ["created_at", "id"])
    if op.get_bind().dialect.name != "postgresql":
        return
    for event, body in TRIGGER_FUNCTIONS.items():
        op.execute(
            f"CREATE FUNCTION {_name(event)}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN{body}\n    RETURN NULL;\nEND $$"
        )
        op.execute(
            f"CREATE TRIGGER {_name(event)} AFTER {event} ON jobs {TRANSITION_TABLES[event]} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {_name(event)}()"
        )
    op.execute(f"INSERT INTO job_count_deltas {COUNT_COLUMNS} {_count_rows('jobs', '1')}")
    op.execute(f"INSERT INTO job_histogram_deltas {HISTOGRAM_COLUMNS} {_histogram_rows('jobs', '1')}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for event in TRIGGER_FUNCTIONS:
            op.execute(f"DROP TRIGGER {_name(event)} ON jobs")
            op.execute(f"DROP FUNCTION {_name(event)}()")
    op.drop_index("ix_files_created_at_id", table_name="files")
    op.drop_index("ix_batches_created_at_id", table_name="batches")
    op.drop_index("ix_jobs_created_at_id", table_name="jobs")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_table("job_histogram_bounds")
    op.drop_table("job_histogram_deltas")
    op.drop_table("job_count_deltas")
