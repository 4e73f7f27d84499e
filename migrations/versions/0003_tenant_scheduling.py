"""tenant scheduling fields: fair-share weight, default and most urgent priority

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 13:00:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("quotas", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), server_default="1.0", nullable=False))
        batch_op.add_column(sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("min_priority", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("quotas", schema=None) as batch_op:
        batch_op.drop_column("min_priority")
        batch_op.drop_column("priority")
        batch_op.drop_column("weight")
