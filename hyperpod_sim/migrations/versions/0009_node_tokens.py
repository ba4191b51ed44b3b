"""node credentials: launch secret, node token, control-plane token

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 08:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('launch_secret_hash', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('token_hash', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('push_token', sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f('ix_nodes_token_hash'), ['token_hash'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_token_hash'))
        batch_op.drop_column('push_token')
        batch_op.drop_column('token_hash')
        batch_op.drop_column('launch_secret_hash')
