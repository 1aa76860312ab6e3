"""Resumable `tokenloom run`: batches.run_key (indexed) and jobs.result_record.

Revision ID: 0002
Revises: 0001
Create Date: 2025-12-09

An offline run is a batch found by its run_key; each finished line is a job row whose
result_record holds the exact result line written, so a resumed run re-emits it byte for byte.
Both columns are nullable: queue batches and jobs leave them empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # batch_alter_table: SQLite cannot add some things in place (env.py sets render_as_batch);
    # on Postgres it issues plain ALTER TABLE statements.
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("run_key", sa.String(length=64), nullable=True))
        batch.create_index("ix_batches_run_key", ["run_key"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_record", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_record")
    with op.batch_alter_table("batches") as batch:
        batch.drop_index("ix_batches_run_key")
        batch.drop_column("run_key")
