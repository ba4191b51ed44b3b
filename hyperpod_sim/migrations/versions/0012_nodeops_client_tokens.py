"""nodeops: client_tokens, the one ClientToken table (BatchAddClusterNodes, CreateClusterExtension);
cluster_extensions.client_token moves into it

Revision ID: 0012_nodeops
Revises: 0011_nodeops
Create Date: 2026-12-01 15:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from hyperpod_sim.models.tables import UtcDateTime

revision = '0012_nodeops'
down_revision = '0011_nodeops'
branch_labels = None
depends_on = None

_TOKENS = sa.table(
    'client_tokens',
    sa.column('cluster_id', sa.String()),
    sa.column('operation', sa.String()),
    sa.column('token', sa.String()),
    sa.column('parameters', sa.JSON()),
    sa.column('result', sa.JSON()),
    sa.column('creation_time', UtcDateTime()),
)
_EXTENSIONS = sa.table(
    'cluster_extensions',
    sa.column('id', sa.String()),
    sa.column('cluster_id', sa.String()),
    sa.column('name', sa.String()),
    sa.column('version', sa.String()),
    sa.column('configuration', sa.JSON()),
    sa.column('client_token', sa.String()),
    sa.column('creation_time', UtcDateTime()),
)


def upgrade() -> None:
    op.create_table(
        'client_tokens',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('cluster_id', sa.String(length=12), nullable=False),
        sa.Column('operation', sa.String(length=64), nullable=False),
        sa.Column('token', sa.String(length=64), nullable=False),
        sa.Column('parameters', sa.JSON(), nullable=False),
        sa.Column('result', sa.JSON(), nullable=False),
        sa.Column('creation_time', UtcDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('cluster_id', 'operation', 'token'),
    )
    with op.batch_alter_table('client_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_client_tokens_creation_time'), ['creation_time'], unique=False)
    bind = op.get_bind()
    kept = bind.execute(sa.select(_EXTENSIONS).where(_EXTENSIONS.c.client_token.is_not(None))).all()
    if kept:
        bind.execute(
            _TOKENS.insert(),
            [
                {
                    'cluster_id': row.cluster_id,
                    'operation': 'CreateClusterExtension',
                    'token': row.client_token,
                    'parameters': {
                        'ExtensionName': row.name,
                        'ExtensionVersion': row.version,
                        'ConfigurationValues': row.configuration,
                    },
                    'result': {'ExtensionId': row.id},
                    'creation_time': row.creation_time,
                }
                for row in kept
            ],
        )
    with op.batch_alter_table('cluster_extensions', schema=None) as batch_op:
        batch_op.drop_column('client_token')


def downgrade() -> None:
    with op.batch_alter_table('cluster_extensions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('client_token', sa.String(length=64), nullable=True))
    bind = op.get_bind()
    for row in bind.execute(
        sa.select(_TOKENS).where(_TOKENS.c.operation == 'CreateClusterExtension')
    ).all():
        bind.execute(
            _EXTENSIONS.update()
            .where(_EXTENSIONS.c.id == row.result['ExtensionId'])
            .values(client_token=row.token)
        )
    with op.batch_alter_table('client_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_client_tokens_creation_time'))
    op.drop_table('client_tokens')
