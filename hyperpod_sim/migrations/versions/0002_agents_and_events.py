"""agents and events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 23:00:58.597386
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

import hyperpod_sim.models.tables


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('cluster_events',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('cluster_id', sa.String(length=12), nullable=False),
    sa.Column('resource_type', sa.String(length=16), nullable=False),
    sa.Column('instance_group_name', sa.String(length=63), nullable=True),
    sa.Column('instance_id', sa.String(length=19), nullable=True),
    sa.Column('event_time', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cluster_events_cluster_id'), ['cluster_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_cluster_events_event_time'), ['event_time'], unique=False)

    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token', sa.String(length=64), nullable=False, server_default=''))
        batch_op.add_column(
            sa.Column('bootstrap_token', sa.String(length=64), nullable=False, server_default='')
        )
    # Clusters made before agents existed get their secrets now.
    clusters = sa.table('clusters', sa.column('id', sa.String), sa.column('token', sa.String),
                        sa.column('bootstrap_token', sa.String))
    connection = op.get_bind()
    for (cluster_id,) in connection.execute(sa.select(clusters.c.id)).all():
        connection.execute(
            clusters.update()
            .where(clusters.c.id == cluster_id)
            .values(token=secrets.token_hex(32), bootstrap_token=secrets.token_hex(32))
        )

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('endpoint', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('pid', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('registered_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_heartbeat', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('acked_generation', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('push_attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('next_push_at', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('push_claimed_until', hyperpod_sim.models.tables.UtcDateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('last_error', sa.Text(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('last_error')
        batch_op.drop_column('push_claimed_until')
        batch_op.drop_column('next_push_at')
        batch_op.drop_column('push_attempts')
        batch_op.drop_column('acked_generation')
        batch_op.drop_column('last_heartbeat')
        batch_op.drop_column('registered_at')
        batch_op.drop_column('pid')
        batch_op.drop_column('endpoint')

    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('bootstrap_token')
        batch_op.drop_column('token')

    with op.batch_alter_table('cluster_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cluster_events_event_time'))
        batch_op.drop_index(batch_op.f('ix_cluster_events_cluster_id'))

    op.drop_table('cluster_events')
