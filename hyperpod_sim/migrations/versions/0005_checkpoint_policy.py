"""checkpoint policy

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 00:26:58.800325
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(sa.Column('checkpoint_policy', sa.JSON(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('checkpoint_policy')

