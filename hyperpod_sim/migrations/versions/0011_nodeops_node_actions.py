"""nodeops: the node operation in progress, node image versions, a cluster's rolling software update

Revision ID: 0011_nodeops
Revises: 0010_apiops
Create Date: 2026-12-01 12:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0011_nodeops'
down_revision = '0010_apiops'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(sa.Column('software_update', sa.JSON(), nullable=True))
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pending_action', sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column('action_due_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('image_version', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('last_software_update', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('last_software_update')
        batch_op.drop_column('image_version')
        batch_op.drop_column('action_due_at')
        batch_op.drop_column('pending_action')
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('software_update')
