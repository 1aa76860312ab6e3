"""Classes of work: jobs.work_class, its index for fair claims, and TTFT/TPOT per class.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07

`work_class` orders work at every stage (store/jobs/work_class.py): interactive (the synchronous
API), jobs (/v1/jobs), batch (Batch API lines, `tokenloom submit`). Existing rows are backfilled:
rows of a batch are batch lines, the others count as jobs (which endpoint made them was not
recorded). `ix_jobs_fair_claim` serves the claim that takes a model's queued batch lines round-robin
across projects.

The histogram deltas gain the class as a key column, and the INSERT and UPDATE trigger functions
of 0006 are replaced by ones that group by it; deltas recorded before this revision keep an empty
class. Downgrade restores 0006's functions first (a plpgsql body naming a missing column fails
only when it runs). The trigger SQL is copied here, not imported: a migration must create the
same functions whenever it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

METRICS = ("ttft_s", "tpot_s", "queue_s", "e2e_s")  # the timing columns 0006's functions aggregate
COUNT_COLUMNS = "(model, project, status, num_jobs, prompt_tokens, completion_tokens)"


def _count_rows(source: str, sign: str) -> str:
    """(model, project, status) -> jobs and tokens of `source`, each row weighted by `sign` (as 0004)."""
    return f"""
    SELECT model, project, status, sum({sign}), coalesce(sum({sign} * prompt_tokens), 0),
           coalesce(sum({sign} * completion_tokens), 0)
    FROM {source} GROUP BY model, project, status"""


def _histogram_rows(source: str, sign: str, keys: Sequence[str]) -> str:
    """(keys..., metric, bucket) -> values and their sum in `source`, each row weighted by `sign`.
    A value's bucket is the smallest bound >= it ('Infinity' catches the rest, NaN included)."""
    picked = ", ".join(keys)
    values = " UNION ALL ".join(
        f"SELECT {picked}, '{metric}' AS metric, {metric} AS value, {sign} AS sign FROM {source} "
        f"WHERE {metric} IS NOT NULL"
        for metric in METRICS
    )
    grouped = ", ".join(f"v.{key}" for key in keys)
    return f"""
    SELECT {grouped}, v.metric, b.le, sum(v.sign), sum(v.sign * v.value)
    FROM ({values}) v
    CROSS JOIN LATERAL (SELECT coalesce(min(le), 'Infinity') AS le FROM job_histogram_bounds
                        WHERE metric = v.metric AND le >= v.value) b
    GROUP BY {grouped}, v.metric, b.le"""


def _histogram_functions(keys: Sequence[str]) -> dict[str, str]:
    """Bodies of the INSERT and UPDATE trigger functions, the histogram deltas keyed by `keys`."""
    columns = f"({', '.join(keys)}, metric, le, num_values, value_sum)"
    names = ", ".join(keys)
    return {
        "INSERT": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS} {_count_rows("new_jobs", "1")};
        INSERT INTO job_histogram_deltas {columns} {_histogram_rows("new_jobs", "1", keys)};""",
        # New rows count +1, old rows -1; keys whose changes cancel (a lease renewal) add no row.
        "UPDATE": f"""
        INSERT INTO job_count_deltas {COUNT_COLUMNS}
        SELECT model, project, status, sum(n), sum(p), sum(c) FROM (
            {_count_rows("new_jobs", "1")} UNION ALL {_count_rows("old_jobs", "-1")}
        ) changes (model, project, status, n, p, c)
        GROUP BY model, project, status HAVING sum(n) <> 0 OR sum(p) <> 0 OR sum(c) <> 0;
        INSERT INTO job_histogram_deltas {columns}
        SELECT {names}, metric, le, sum(n), sum(s) FROM (
            {_histogram_rows("new_jobs", "1", keys)} UNION ALL {_histogram_rows("old_jobs", "-1", keys)}
        ) changes ({names}, metric, le, n, s)
        GROUP BY {names}, metric, le HAVING sum(n) <> 0 OR sum(s) <> 0;""",
    }


def _replace_functions(keys: Sequence[str]) -> None:
    # CREATE OR REPLACE keeps the function's identity, so 0004's triggers call the new body.
    for event, body in _histogram_functions(keys).items():
        op.execute(
            f"CREATE OR REPLACE FUNCTION jobs_aggregates_on_{event.lower()}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$\nBEGIN{body}\n    RETURN NULL;\nEND $$"
        )


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column(
                "work_class",
                sa.Enum(
                    "interactive",
                    "jobs",
                    "batch",
                    name="work_class",
                    native_enum=False,
                    create_constraint=False,
                    length=16,
                ),
                nullable=False,
                server_default="jobs",
            )
        )
    op.execute("UPDATE jobs SET work_class = 'batch' WHERE batch_id IS NOT NULL")
    op.create_index("ix_jobs_fair_claim", "jobs", ["model", "work_class", "status", "project", "created_at"])
    with op.batch_alter_table("job_histogram_deltas") as batch:
        batch.add_column(sa.Column("work_class", sa.String(16), nullable=False, server_default=""))
    if op.get_bind().dialect.name == "postgresql":
        _replace_functions(("model", "work_class"))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _replace_functions(("model",))
    with op.batch_alter_table("job_histogram_deltas") as batch:
        batch.drop_column("work_class")
    op.drop_index("ix_jobs_fair_claim", "jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("work_class")
