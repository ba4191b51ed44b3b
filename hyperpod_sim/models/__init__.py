"""Persistence only: SQLAlchemy tables and the engine/session factory."""

from hyperpod_sim.models.db import Database
from hyperpod_sim.models.tables import (
    Base,
    CheckpointNamespace,
    ClientToken,
    Cluster,
    ClusterEvent,
    ClusterExtension,
    ClusterOperation,
    ClusterSchedulerConfig,
    InstanceGroup,
    Job,
    JobAttempt,
    Node,
    NodeAttachment,
    Tag,
)

__all__ = [
    "Base",
    "CheckpointNamespace",
    "ClientToken",
    "Cluster",
    "ClusterEvent",
    "ClusterExtension",
    "ClusterOperation",
    "ClusterSchedulerConfig",
    "Database",
    "InstanceGroup",
    "Job",
    "JobAttempt",
    "Node",
    "NodeAttachment",
    "Tag",
]
