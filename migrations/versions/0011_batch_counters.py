"""Batch request counts and token usage kept with the rows (batch_count_deltas); batch expiry.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08

A batch's `request_counts` and `usage` were summed over its job rows on every GET: each poll of a
1,000,000-line batch read a million rows. Statement-level triggers on `jobs` now append one row per
(batch, status) a statement changes to `batch_count_deltas`, as 0004's triggers do for the model
aggregates (store/jobs/job_aggregates.py explains the design: append-only, inside the writer's
transaction, compacted by readers), and GET sums a batch's few deltas (store/batches/
batch_counters.py). Unlike the model aggregates, deleting rows takes their tokens away too: a
batch's figures are always the sums over the lines it still has.

Safe on a big table: nothing here reads or rewrites `jobs`, so writers wait only for the few
milliseconds the DDL holds its locks, whatever the table's size. Batches made before this revision
are not backfilled: `batches.counted_by_triggers` is false for them (added with that default, which
Postgres records without rewriting a row) and true for every batch made after (the default is then
changed), and the reader counts the old ones from their rows as before. The trigger SQL is written
here, not imported: a migration must create the same functions whenever it runs.

`batches.expired_at` records when a batch's completion window ended before its lines did, and
`ix_batches_status_expires_at` serves the sweep that finds such batches (store/batches/batch_expiry.py).
`batches.output_expires_after_s` and `files.expires_at` (indexed) let a batch's output and error
files expire as OpenAI's `output_expires_after` asks (store/files/file_expiry.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = "(batch_id, status, num_jobs, prompt_tokens, completion_tokens)"


def _rows(source: str, sign: str) -> str:
    """(batch, status) -> lines and their tokens in `source`, each weighted by `sign`."""
    return f"""
    SELECT batch_id, status, sum({sign}), coalesce(sum({sign} * prompt_tokens), 0),
           coalesce(sum({sign} * completion_tokens), 0)
    FROM {source} WHERE batch_id IS NOT NULL GROUP BY batch_id, status"""


FUNCTIONS = {
    "INSERT": f"""
        INSERT INTO batch_count_deltas {COLUMNS} {_rows("new_jobs", "1")};""",
    # Keys whose changes cancel (a lease renewal, a cancel poll) add no row.
    "UPDATE": f"""
        INSERT INTO batch_count_deltas {COLUMNS}
        SELECT batch_id, status, sum(n), sum(p), sum(c) FROM (
            {_rows("new_jobs", "1")} UNION ALL {_rows("old_jobs", "-1")}
        ) changes (batch_id, status, n, p, c)
        GROUP BY batch_id, status HAVING sum(n) <> 0 OR sum(p) <> 0 OR sum(c) <> 0;""",
    "DELETE": f"""
        INSERT INTO batch_count_deltas {COLUMNS} {_rows("old_jobs", "-1")};""",
    "TRUNCATE": """
        DELETE FROM batch_count_deltas;""",
}
TRANSITION_TABLES = {
    "INSERT": "REFERENCING NEW TABLE AS new_jobs",
    "UPDATE": "REFERENCING OLD TABLE AS old_jobs NEW TABLE AS new_jobs",
    "DELETE": "REFERENCING OLD TABLE AS old_jobs",
    "TRUNCATE": "",  # TRUNCATE has no transition tables
}


def _name(event: str) -> str:
    return f"jobs_batch_counts_on_{event.lower()}"


def upgrade() -> None:
    op.create_table(
        "batch_count_deltas",
        sa.Column("batch_id", sa.Uuid(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("num_jobs", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_batch_count_deltas_batch_id", "batch_count_deltas", ["batch_id"])
    # `batches` is locked before `jobs` (its triggers, below): the order the API's batch submission
    # takes them in, so this migration cannot deadlock with one.
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("counted_by_triggers", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("output_expires_after_s", sa.Integer(), nullable=True))
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    with op.batch_alter_table("batches") as batch:
        batch.alter_column("counted_by_triggers", server_default=sa.true())
    op.create_index("ix_batches_status_expires_at", "batches", ["status", "expires_at"])
    if op.get_bind().dialect.name != "postgresql":
        return
    for event, body in FUNCTIONS.items():
        op.execute(
            f"CREATE FUNCTION {_name(event)}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            f"BEGIN{body}\n    RETURN NULL;\nEND $$"
        )
        op.execute(
            f"CREATE TRIGGER {_name(event)} AFTER {event} ON jobs {TRANSITION_TABLES[event]} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {_name(event)}()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for event in FUNCTIONS:
            op.execute(f"DROP TRIGGER {_name(event)} ON jobs")
            op.execute(f"DROP FUNCTION {_name(event)}()")
    op.drop_index("ix_files_expires_at", table_name="files")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("expires_at")
    op.drop_index("ix_batches_status_expires_at", table_name="batches")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_after_s")
        batch.drop_column("counted_by_triggers")
        batch.drop_column("expired_at")
    op.drop_index("ix_batch_count_deltas_batch_id", table_name="batch_count_deltas")
    op.drop_table("batch_count_deltas")
