"""Scoring requests: jobs.echo and jobs.prompt_logprobs.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

`echo` records that a /v1/completions request asked for its prompt before each choice (OpenAI's
`echo`); `prompt_logprobs` holds the logprob of each prompt token the engine computed (vLLM's
`prompt_logprobs`, or `echo` with `logprobs`). Existing rows asked for neither: false and null.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("echo", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("prompt_logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prompt_logprobs")
        batch.drop_column("echo")
