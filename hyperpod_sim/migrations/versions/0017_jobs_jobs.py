"""jobs: training jobs on a cluster's nodes and their attempts (hyperpod-sim job run)

Revision ID: 0017_jobs
Revises: 0016_nodeaddr
Create Date: 2026-12-04 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from hyperpod_sim.models.tables import UtcDateTime

revision = "0017_jobs"
down_revision = "0016_nodeaddr"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=18), nullable=False),
        sa.Column("cluster_id", sa.String(length=12), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("node_count", sa.Integer(), nullable=True),
        sa.Column("procs_per_node", sa.Integer(), nullable=False),
        sa.Column("auto_resume", sa.Boolean(), nullable=False),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("stop_requested", sa.Boolean(), nullable=False),
        sa.Column("supervisor_pid", sa.Integer(), nullable=True),
        sa.Column("supervisor_start_time", sa.BigInteger(), nullable=True),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("created_at", UtcDateTime(), nullable=False),
        sa.Column("ended_at", UtcDateTime(), nullable=True),
        sa.ForeignKeyConstraint(["cluster_id"], ["clusters.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("cluster_id", "name"),
    )
    op.create_index(op.f("ix_jobs_cluster_id"), "jobs", ["cluster_id"], unique=False)
    op.create_table(
        "job_attempts",
        sa.Column("job_id", sa.String(length=18), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("slots", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", UtcDateTime(), nullable=False),
        sa.Column("ended_at", UtcDateTime(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("cause", sa.String(length=16), nullable=True),
        sa.Column("cause_node", sa.String(length=19), nullable=True),
        sa.Column("cause_rank", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "number"),
    )


def downgrade() -> None:
    op.drop_table("job_attempts")
    op.drop_index(op.f("ix_jobs_cluster_id"), table_name="jobs")
    op.drop_table("jobs")
