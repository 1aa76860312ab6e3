"""Batch files stored in chunks (streamed upload, parse and output build).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04

A file's bytes move to `file_chunks` rows (store/files/file_chunks.py) so no file up to 200 MB is
ever whole in memory; `files.content` becomes nullable and keeps the bytes of rows written
before, which readers still return. jobs gets an index on (batch_id, line_number): the batch
finalizer pages through a batch's rows in line order.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # batch_alter_table: SQLite copies the table to change a column's nullability (env.py sets
    # render_as_batch); on Postgres it is a plain ALTER TABLE. Done before file_chunks exists, so
    # SQLite's copy of `files` has no new table referring to it.
    with op.batch_alter_table("files") as batch:
        batch.alter_column("content", existing_type=sa.LargeBinary(), nullable=True)
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "seq"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.create_index("ix_jobs_batch_id_line_number", ["batch_id", "line_number"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_batch_id_line_number")
    _join_chunks_into_content()
    op.drop_table("file_chunks")
    with op.batch_alter_table("files") as batch:
        batch.alter_column("content", existing_type=sa.LargeBinary(), nullable=False)


def _join_chunks_into_content() -> None:
    """Revision 0002 keeps a file's bytes in files.content (NOT NULL): join each chunked file back.
    One file at a time in memory, which is what 0002 itself needs to serve it."""
    bind = op.get_bind()
    files = sa.table("files", sa.column("id", sa.String), sa.column("content", sa.LargeBinary))
    chunks = sa.table(
        "file_chunks", sa.column("file_id", sa.String), sa.column("seq", sa.Integer), sa.column("data", sa.LargeBinary)
    )
    chunked = bind.execute(sa.select(files.c.id).where(files.c.content.is_(None))).scalars().all()
    for file_id in chunked:
        parts = bind.execute(
            sa.select(chunks.c.data).where(chunks.c.file_id == file_id).order_by(chunks.c.seq)
        ).scalars()
        bind.execute(sa.update(files).where(files.c.id == file_id).values(content=b"".join(parts)))
