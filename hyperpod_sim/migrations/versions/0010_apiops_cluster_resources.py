"""cluster operation records; the operation id of events and of the cluster's operation in progress;
cluster scheduler configs; cluster extensions; node attachments

Revision ID: 0010_apiops
Revises: 0009
Create Date: 2026-12-01 12:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from hyperpod_sim.models.tables import UtcDateTime

revision = '0010_apiops'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'cluster_operations',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('cluster_id', sa.String(length=12), nullable=False),
        sa.Column('type', sa.String(length=32), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('requested_by', sa.String(length=64), nullable=False),
        sa.Column('creation_time', UtcDateTime(), nullable=False),
        sa.Column('end_time', UtcDateTime(), nullable=True),
        sa.Column('node_ids', sa.JSON(), nullable=False),
        sa.Column('details', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('cluster_operations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cluster_operations_cluster_id'), ['cluster_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_cluster_operations_creation_time'), ['creation_time'], unique=False)
    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('operation_id', sa.String(length=36), nullable=True))
        batch_op.create_index(batch_op.f('ix_cluster_events_operation_id'), ['operation_id'], unique=False)
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(sa.Column('operation_id', sa.String(length=36), nullable=True))
    op.create_table(
        'cluster_scheduler_configs',
        sa.Column('id', sa.String(length=12), nullable=False),
        sa.Column('arn', sa.String(length=256), nullable=False),
        sa.Column('name', sa.String(length=63), nullable=False),
        sa.Column('cluster_id', sa.String(length=12), nullable=False),
        sa.Column('status', sa.String(length=32), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('creation_time', UtcDateTime(), nullable=False),
        sa.Column('last_modified_time', UtcDateTime(), nullable=False),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.Column('versions', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('arn'),
        sa.UniqueConstraint('cluster_id'),
    )
    op.create_table(
        'cluster_extensions',
        sa.Column('id', sa.String(length=12), nullable=False),
        sa.Column('arn', sa.String(length=256), nullable=False),
        sa.Column('cluster_id', sa.String(length=12), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('version', sa.String(length=64), nullable=False),
        sa.Column('configuration', sa.JSON(), nullable=True),
        sa.Column('phase', sa.String(length=16), nullable=False),
        sa.Column('client_token', sa.String(length=64), nullable=True),
        sa.Column('creation_time', UtcDateTime(), nullable=False),
        sa.Column('last_modified_time', UtcDateTime(), nullable=False),
        sa.Column('tags', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('arn'),
        sa.UniqueConstraint('cluster_id', 'name'),
    )
    with op.batch_alter_table('cluster_extensions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cluster_extensions_cluster_id'), ['cluster_id'], unique=False)
    op.create_table(
        'node_attachments',
        sa.Column('id', sa.String(length=28), nullable=False),
        sa.Column('cluster_id', sa.String(length=12), nullable=False),
        sa.Column('node_id', sa.String(length=19), nullable=False),
        sa.Column('kind', sa.String(length=20), nullable=False),
        sa.Column('resource_id', sa.String(length=256), nullable=False),
        sa.Column('device_name', sa.String(length=32), nullable=True),
        sa.Column('attach_time', UtcDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('kind', 'resource_id'),
    )
    with op.batch_alter_table('node_attachments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_node_attachments_cluster_id'), ['cluster_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_node_attachments_node_id'), ['node_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('node_attachments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_node_attachments_node_id'))
        batch_op.drop_index(batch_op.f('ix_node_attachments_cluster_id'))
    op.drop_table('node_attachments')
    with op.batch_alter_table('cluster_extensions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_extensions_cluster_id'))
    op.drop_table('cluster_extensions')
    op.drop_table('cluster_scheduler_configs')
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('operation_id')
    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_events_operation_id'))
        batch_op.drop_column('operation_id')
    with op.batch_alter_table('cluster_operations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_operations_creation_time'))
        batch_op.drop_index(batch_op.f('ix_cluster_operations_cluster_id'))
    op.drop_table('cluster_operations')
