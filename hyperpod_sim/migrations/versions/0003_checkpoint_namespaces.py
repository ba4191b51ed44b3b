"""checkpoint namespaces

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 23:22:09.287336
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('checkpoint_namespaces',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('cluster_id', sa.String(length=12), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('num_ranks', sa.Integer(), nullable=False),
    sa.Column('steps_retained', sa.Integer(), nullable=False),
    sa.Column('created_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('cluster_id', 'name')
    )
    with op.batch_alter_table('checkpoint_namespaces', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoint_namespaces_cluster_id'), ['cluster_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('checkpoint_namespaces', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoint_namespaces_cluster_id'))

    op.drop_table('checkpoint_namespaces')
