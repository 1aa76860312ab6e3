"""End-to-end latency per job (jobs.e2e_s) and its trigger-kept histogram for /metrics.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06

Adds the column, its bucket bounds in job_histogram_bounds, and replaces the INSERT and UPDATE
trigger functions of revision 0004 (the ones that write job_histogram_deltas) by ones that also
aggregate e2e_s; the DELETE and TRUNCATE functions write no histograms and stay as they are.
Existing rows have no e2e_s, so there is nothing to backfill: the histogram counts the jobs that
finish after the upgrade. Downgrade restores 0004's functions before dropping the column, since
a plpgsql body naming a missing column fails only when it runs.

The trigger SQL and the bounds are copied here, not imported: a migration must create the same
functions and rows whenever it runs. tests/api/test_job_aggregates.py checks that 0004's bounds
plus these equal store/jobs/job_stats.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

METRIC = "e2e_s"
E2E_BOUNDS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
    14400.0,
    43200.0,
    86400.0,
)
METRICS_0004 = ("ttft_s", "tpot_s", "queue_s")  # the timing columns 0004's trigger functions aggregate


def _count_rows(source: str, sign: str) -> str:
    """(model, project, status) -> jobs and tokens of `source`, each row weighted by `sign` (as 0004)."""
    return f"""
    SELECT model, project, status, sum({sign}), coalesce(sum({sign} * prompt_tokens), 0),
           coalesce(sum({sign} * completion_tokens), 0)
    FROM {source} GROUP BY model, project, status"""


def _histogram_rows(source: str, sign: str, metrics: Sequence[str]) -> str:
    """(model, metric, bucket) -> values and their sum in `source`, each row weighted by `sign` (as 0004).
    A value's bucket is the smallest bound >= it ('Infinity' catches the rest, NaN included)."""
    values = " UNION ALL ".join(
        f"SELECT model, '{metric}' AS metric, {metric} AS value, {sign} AS sign FROM {source} "
        f"WHERE {metric} IS NOT NULL"
        for metric in metrics
    )
    return f"""
    SELECT v.model, v.metric, b.le, sum(v.sign), sum(v.sign * v.value)
    FROM ({values}) v
    CROSS JOIN LATERAL (SELECT coalesce(min(le), 'Infinity') AS le FROM job_histogram_bounds
                        WHERE metric = v.metric AND le >= v.value) b
    GROUP BY v.model, v.metric, b.le"""


COUNT_COLUMNS = "(model, project, status, num_jobs, prompt_tokens, completion_tokens)"
HISTOGRAM_COLUMNS = "(model, metric, le, num_values, value_sum)"


def _histogram_functions(metrics: Sequence[str]) -> dict[str, str]:
    """Bodies of 0004's INSERT and UPDATE trigger functions, aggregating the timing columns `metrics`."""
    return {
        "INSERT": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS} {_count_rows("new_jobs", "1")};
        INSERT INTO job_histogram_deltas {HISTOGRAM_COLUMNS} {_histogram_rows("new_jobs", "1", metrics)};""",
        # New rows count +1, old rows -1; keys whose changes cancel (a lease renewal) add no row.
        "UPDATE": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS}
        SELECT model, project, status, sum(n), sum(p), sum(c) FROM (
            {_count_rows("new_jobs", "1")} UNION ALL {_count_rows("old_jobs", "-1")}
        ) changes (model, project, status, n, p, c)
        GROUP BY model, project, status HAVING sum(n) <> 0 OR sum(p) <> 0 OR sum(c) <> 0;
        INSERT INTO job_histogram_deltas {HISTOGRAM_COLUMNS}
        SELECT model, metric, le, sum(n), sum(s) FROM (
            {_histogram_rows("new_jobs", "1", metrics)} UNION ALL {_histogram_rows("old_jobs", "-1", metrics)}
        ) changes (model, metric, le, n, s)
        GROUP BY model, metric, le HAVING sum(n) <> 0 OR sum(s) <> 0;""",
    }


def _replace_functions(metrics: Sequence[str]) -> None:
    # CREATE OR REPLACE keeps the function's identity, so 0004's triggers call the new body.
    for event, body in _histogram_functions(metrics).items():
        op.execute(
            f"CREATE OR REPLACE FUNCTION jobs_aggregates_on_{event.lower()}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$\nBEGIN{body}\n    RETURN NULL;\nEND $$"
        )


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("e2e_s", sa.Float(), nullable=True))
    bounds = sa.table("job_histogram_bounds", sa.column("metric", sa.String(16)), sa.column("le", sa.Float()))
    op.bulk_insert(bounds, [{"metric": METRIC, "le": le} for le in (*E2E_BOUNDS, float("inf"))])
    if op.get_bind().dialect.name == "postgresql":
        _replace_functions((*METRICS_0004, METRIC))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace_functions(METRICS_0004)
    op.execute(sa.text("DELETE FROM job_histogram_deltas WHERE metric = :metric").bindparams(metric=METRIC))
    op.execute(sa.text("DELETE FROM job_histogram_bounds WHERE metric = :metric").bindparams(metric=METRIC))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("e2e_s")
