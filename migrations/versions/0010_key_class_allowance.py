"""Classes of work per key: api_keys.allow_priority_tier and api_keys.min_priority.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-14

Who may use which class of work (api/class_allowance.py, docs/priority.md). The server defaults
hold every existing key to what is safe for any tenant: `allow_priority_tier` false (a
`service_tier: "priority"` on /v1/jobs is refused, the interactive class stays the synchronous
endpoints') and `min_priority` 0 (every request's default priority: a key can order its own work
with higher values but never preempt another project's). Admin keys (`is_admin`) may use anything
whatever these say. The default is written here, not imported: a migration must create the same
columns whenever it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("allow_priority_tier", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("min_priority", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("min_priority")
        batch.drop_column("allow_priority_tier")
