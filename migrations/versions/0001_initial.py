"""Initial schema: files, batches, jobs, api_keys (exactly store/models.py at revision 0001).

Revision ID: 0001
Revises:
Create Date: 2025-12-02

Statuses are VARCHAR(16) holding the enum values (non-native Enum). Like the model, which
leaves SQLAlchemy's default `create_constraint=False`, no CHECK constraint is created.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JOB_STATUSES = ("queued", "running", "cancelling", "succeeded", "failed", "cancelled")
BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)


def _status(values: tuple[str, ...], name: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=False, length=16)


def _timestamp(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        _timestamp("created_at", nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_files_project_created_at", "files", ["project", "created_at"])

    op.create_table(
        "batches",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", _status(BATCH_STATUSES, "batch_status"), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        _timestamp("created_at", nullable=False),
        _timestamp("in_progress_at"),
        _timestamp("finalizing_at"),
        _timestamp("completed_at"),
        _timestamp("failed_at"),
        _timestamp("expires_at"),
        _timestamp("cancelling_at"),
        _timestamp("cancelled_at"),
        sa.ForeignKeyConstraint(["input_file_id"], ["files.id"]),
        sa.ForeignKeyConstraint(["output_file_id"], ["files.id"]),
        sa.ForeignKeyConstraint(["error_file_id"], ["files.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_batches_project_created_at", "batches", ["project", "created_at"])

    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("batch_id", sa.Uuid(), nullable=True),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("custom_id", sa.String(length=512), nullable=True),
        sa.Column("line_number", sa.Integer(), nullable=True),
        sa.Column("input_hash", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", _status(JOB_STATUSES, "job_status"), nullable=False),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("output_token_ids", sa.JSON(), nullable=True),
        sa.Column("choices", sa.JSON(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=256), nullable=True),
        _timestamp("lease_expires_at"),
        _timestamp("created_at", nullable=False),
        _timestamp("admitted_at"),
        _timestamp("first_token_at"),
        _timestamp("finished_at"),
        sa.Column("queue_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("tpot_s", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
    )
    op.create_index("ix_jobs_status_created_at", "jobs", ["status", "created_at"])
    op.create_index("ix_jobs_batch_id_status", "jobs", ["batch_id", "status"])
    op.create_index("ix_jobs_project_created_at", "jobs", ["project", "created_at"])
    op.create_index("ix_jobs_input_hash", "jobs", ["input_hash"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("project", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("key_prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=128), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        _timestamp("created_at", nullable=False),
        _timestamp("revoked_at"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),  # unnamed, as in the model (Postgres names it api_keys_key_hash_key)
    )
    op.create_index("ix_api_keys_project", "api_keys", ["project"])


def downgrade() -> None:
    # Dropping a table drops its indexes and constraints; children before parents.
    op.drop_table("api_keys")
    op.drop_table("jobs")
    op.drop_table("batches")
    op.drop_table("files")
