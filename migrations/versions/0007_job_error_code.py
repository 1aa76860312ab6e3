"""The kind of a job's failure as a column: jobs.error_code.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07

Until now the kind of a failure was read from the start of its message ("engine error: ...",
"gave up after ..."), by two rules that disagreed. The column holds it (store/models.py's
JobErrorCode). Upgrading backfills the rows that already ended from those same message prefixes,
which every writer used; any other failed row was a refused request. Downgrade drops the column:
the messages keep their words.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (message prefix, code), as the writers before this revision worded them; copied, not imported.
PREFIXES = (
    ("engine error", "engine_error"),
    ("gave up", "gave_up"),
    ("could not be queued", "queue_unavailable"),
    ("could not read the engine output", "result_unstored"),
    ("could not store the result", "result_unstored"),
)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column(
                "error_code",
                sa.Enum(
                    "invalid_request",
                    "engine_error",
                    "gave_up",
                    "queue_unavailable",
                    "result_unstored",
                    "cancelled",
                    name="job_error_code",
                    native_enum=False,
                    create_constraint=False,
                    length=32,
                ),
                nullable=True,
            )
        )
    cases = " ".join(f"WHEN error LIKE '{prefix}%' THEN '{code}'" for prefix, code in PREFIXES)
    op.execute(f"UPDATE jobs SET error_code = CASE {cases} ELSE 'invalid_request' END WHERE status = 'failed'")
    op.execute("UPDATE jobs SET error_code = 'cancelled' WHERE status = 'cancelled'")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("error_code")
