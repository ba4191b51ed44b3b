"""node slots

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 23:46:58.921158
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('slot', sa.Integer(), server_default='0', nullable=False))



def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('slot')

