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
    failed_in_a_row: int = 0,
) -> Node:
    """A Pending node in ``group`` (in ``slot``, or the lowest free one), with its event; its agent
    starts once the transaction has committed. ``failed_in_a_row``: its slot's nodes that failed
    before their agent registered, in a row (hyperpod_sim/domain/recovery.py), for a replacement."""
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
        start_failures=0,
        failed_in_a_row=failed_in_a_row,
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


FAILED_PREFIX = "Node failed: "


def fail_node(
    session: Session, cluster: Cluster, node: Node, now: datetime, reason: str, *, ids: Ids
) -> None:
    """Mark a node failed, with the reason in its status and an Error event. One that failed before
    its agent ever registered adds to its slot's failures in a row (hyperpod_sim/domain/recovery.py);
    one whose agent did ends them."""
    node.failed_in_a_row = node.failed_in_a_row + 1 if node.last_heartbeat is None else 0
    node.status_message = f"{FAILED_PREFIX}{reason}."
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
