"""Cluster events: what happened to a cluster, its groups and its nodes, with timestamps; and
``move``, the one way their statuses change (checked against hyperpod_sim/domain/lifecycle.py's tables)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy.orm import Session

from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.lifecycle import ClusterStatus, GroupStatus, NodeStatus, check_transition
from hyperpod_sim.models import Cluster, ClusterEvent, InstanceGroup, Node


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
        operation_id=cluster.operation_id,
    )
    session.add(event)
    return event


def node_event(
    session: Session, node: Node, description: str, *, ids: Ids, now: datetime, level: Level = Level.INFO
) -> ClusterEvent:
    """An event about ``node``, in the cluster it belongs to (``record`` for the common case)."""
    return record(
        session, ids=ids, now=now, cluster=node.cluster, node=node, level=level, description=description
    )


def move(
    session: Session,
    entity: Cluster | InstanceGroup | Node,
    target: ClusterStatus | GroupStatus | NodeStatus,
    *,
    ids: Ids,
    now: datetime,
    cluster: Cluster | None = None,
    description: str | None = None,
    level: Level = Level.INFO,
) -> None:
    """Move a cluster, group or node to ``target`` (a bug if its transition table does not allow
    it) and, with ``description``, record the event that says so, in the caller's transaction.
    ``cluster``: where the event goes, by default the group's or node's own cluster."""
    if isinstance(entity, Cluster):
        entity.status = check_transition(entity.status, ClusterStatus(target))
        cluster = entity
    elif isinstance(entity, InstanceGroup):
        entity.status = check_transition(entity.status, GroupStatus(target))
    else:
        entity.status = check_transition(entity.status, NodeStatus(target))
    if description is None:
        return
    if cluster is None:
        cluster = entity if isinstance(entity, Cluster) else entity.cluster
    record(
        session,
        ids=ids,
        now=now,
        cluster=cluster,
        description=description,
        node=entity if isinstance(entity, Node) else None,
        group_name=entity.name if isinstance(entity, InstanceGroup) else None,
        level=level,
    )
