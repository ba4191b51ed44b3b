"""move: a node's MoveClusterNodes under way (its source and target cluster and group)

Revision ID: 0014_move
Revises: 0013_nodeops
Create Date: 2026-12-01 15:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0014_move'
down_revision = '0013_nodeops'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('move', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('move')
