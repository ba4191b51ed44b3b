"""Persistence only: SQLAlchemy tables and the engine/session factory."""

from models.db import Database
from models.tables import Base, CheckpointNamespace, Cluster, ClusterEvent, InstanceGroup, Node, Tag

__all__ = [
    "Base",
    "CheckpointNamespace",
    "Cluster",
    "ClusterEvent",
    "Database",
    "InstanceGroup",
    "Node",
    "Tag",
]
