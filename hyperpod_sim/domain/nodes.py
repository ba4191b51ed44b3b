"""A cluster's nodes as the reconciler makes and fails them, each with its event."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LEAVING, NodeStatus
from hyperpod_sim.models import Cluster, InstanceGroup, Node


def new_node(
    session: Session,
    cluster: Cluster,
    group: InstanceGroup,
    now: datetime,
    *,
    ids: Ids,
    ready_delay_s: float,
    slot: int | None = None,
) -> Node:
    """A Pending node in ``group`` (in ``slot``, or the lowest free one), with its event; its agent
    starts once the transaction has committed."""
    if slot is None:
        taken = {n.slot for n in cluster.nodes if n.group_name == group.name and n.status not in LEAVING}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
    node_id = ids.node_id()
    node = Node(
        slot=slot,
        id=node_id,
        cluster_id=cluster.id,
        group_name=group.name,
        logical_id=f"{group.name}-{node_id[2:]}",
        instance_type=group.instance_type,
        status=NodeStatus.PENDING,
        status_message=None,
        launch_time=now,
        ready_at=now + timedelta(seconds=ready_delay_s),
        private_ip=ids.private_ip(),
        acked_generation=0,
        push_attempts=0,
    )
    cluster.nodes.append(node)
    events.record(
        session,
        ids=ids,
        now=now,
        cluster=cluster,
        node=node,
        description=f"Node {node.id} launched in group {group.name}.",
    )
    return node


def fail_node(
    session: Session, cluster: Cluster, node: Node, now: datetime, reason: str, *, ids: Ids
) -> None:
    """Mark a node failed, with the reason in its status and an Error event."""
    node.status_message = f"Node failed: {reason}."
    events.move(
        session,
        node,
        NodeStatus.FAILURE,
        ids=ids,
        now=now,
        cluster=cluster,
        level=Level.ERROR,
        description=f"Node {node.id} failed: {reason}.",
    )
