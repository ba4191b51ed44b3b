"""checkpoint token: what trainers send to the agents' checkpoint routes when AgentAccess is Token

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 09:00:00.000000
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('checkpoint_token', sa.String(length=64), nullable=False, server_default='')
        )
    # Clusters made before the checkpoint token existed get theirs now.
    clusters = sa.table('clusters', sa.column('id', sa.String), sa.column('checkpoint_token', sa.String))
    connection = op.get_bind()
    for (cluster_id,) in connection.execute(sa.select(clusters.c.id)).all():
        connection.execute(
            clusters.update().where(clusters.c.id == cluster_id).values(checkpoint_token=secrets.token_hex(32))
        )


def downgrade() -> None:
    with op.batch_alter_table('clusters', schema=None) as batch_op:
        batch_op.drop_column('checkpoint_token')
