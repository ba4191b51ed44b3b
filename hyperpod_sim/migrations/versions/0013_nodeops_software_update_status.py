"""nodeops: the SoftwareUpdateStatus of an instance group's last software update

Revision ID: 0013_nodeops
Revises: 0012_nodeops
Create Date: 2026-12-01 15:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013_nodeops'
down_revision = '0012_nodeops'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('instance_groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('software_update_status', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('instance_groups', schema=None) as batch_op:
        batch_op.drop_column('software_update_status')
