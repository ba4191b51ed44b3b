"""nodeaddr: an address per node, for its whole life (its agent listens at port 9200 of it)

Revision ID: 0016_nodeaddr
Revises: 0015_spawnloop
Create Date: 2026-12-03 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0016_nodeaddr'
down_revision = '0015_spawnloop'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('address', sa.String(length=15), nullable=True))
        batch_op.create_index(batch_op.f('ix_nodes_address'), ['address'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_address'))
        batch_op.drop_column('address')
