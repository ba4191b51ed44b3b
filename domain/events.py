"""Cluster events: what happened to a cluster, its groups and its nodes, with timestamps."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy.orm import Session

from domain.clock import Ids
from models import Cluster, ClusterEvent, Node


class Level(StrEnum):
    INFO = "Info"
    WARN = "Warn"
    ERROR = "Error"


def record(
    session: Session,
    *,
    ids: Ids,
    now: datetime,
    cluster: Cluster,
    description: str,
    node: Node | None = None,
    group_name: str | None = None,
    level: Level = Level.INFO,
) -> ClusterEvent:
    """Add an event in the caller's transaction (it commits or rolls back with the change)."""
    if node is not None:
        resource_type = "Instance"
        group_name = node.group_name
    elif group_name is not None:
        resource_type = "InstanceGroup"
    else:
        resource_type = "Cluster"
    event = ClusterEvent(
        id=ids.event_id(),
        cluster_id=cluster.id,
        resource_type=resource_type,
        instance_group_name=group_name,
        instance_id=node.id if node is not None else None,
        event_time=now,
        level=level,
        description=description,
    )
    session.add(event)
    return event
