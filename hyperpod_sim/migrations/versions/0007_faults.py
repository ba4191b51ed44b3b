"""faults

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 09:12:40.512317
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(sa.Column('faults', sa.JSON(), nullable=True))

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('agent_restarts', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('agent_restarted_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('agent_restarted_at')
        batch_op.drop_column('agent_restarts')

    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('faults')
