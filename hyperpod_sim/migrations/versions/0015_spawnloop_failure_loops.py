"""spawnloop: bounded failure loops (a node's failed agent starts, its slot's failures in a row, a
group's stopped recovery)

Revision ID: 0015_spawnloop
Revises: 0014_move
Create Date: 2026-12-02 08:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0015_spawnloop'
down_revision = '0014_move'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('instance_groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('recovery_stopped', sa.Text(), nullable=True))

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('start_failures', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('next_start_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('failed_in_a_row', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('failed_in_a_row')
        batch_op.drop_column('next_start_at')
        batch_op.drop_column('start_failures')

    with op.batch_alter_table('instance_groups', schema=None) as batch_op:
        batch_op.drop_column('recovery_stopped')
