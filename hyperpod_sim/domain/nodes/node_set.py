"""A cluster's nodes as the reconciler makes and fails them, each with its event."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from hyperpod_sim.domain import events
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LEAVING, NodeStatus
from hyperpod_sim.models import Cluster, InstanceGroup, Node


class NodeAddresses(Protocol):
    """Where a new node's address comes from (hyperpod_sim/infra/addresses.py on the loopback
    network): it is the node's for life, its agent listens at port 9200 of it, and DescribeClusterNode
    shows it as PrivatePrimaryIp."""

    def draw(self, taken: Callable[[str], bool]) -> str | None:
        """A free address, not one that ``taken`` says a node has; None: the node gets none (the
        shared network, where agents take a free port of 127.0.0.1 each)."""


class NoAddresses:
    """No address of its own for a new node: the shared network, and external agents (a node's
    address is the host that its agent registers from, domain/nodes/agents.py)."""

    def draw(self, taken: Callable[[str], bool]) -> str | None:
        return None


NO_ADDRESSES = NoAddresses()


def new_node(
    session: Session,
    cluster: Cluster,
    group: InstanceGroup,
    now: datetime,
    *,
    ids: Ids,
    ready_delay_s: float,
    addresses: NodeAddresses,
    slot: int | None = None,
    failed_in_a_row: int = 0,
) -> Node:
    """A Pending node in ``group`` (in ``slot``, or the lowest free one), with its event and its
    address from ``addresses`` (a replacement is a new node: a new address); its agent
    starts once the transaction has committed. ``failed_in_a_row``: its slot's nodes that failed
    before their agent registered, in a row (hyperpod_sim/domain/nodes/recovery.py), for a replacement."""
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
        address=addresses.draw(lambda address: _has_node(session, address)),
        acked_generation=0,
        push_attempts=0,
        start_failures=0,
        failed_in_a_row=failed_in_a_row,
    )
    cluster.nodes.append(node)
    events.node_event(
        session,
        node,
        f"Node {node.id} launched in group {group.name}.",
        ids=ids,
        now=now,
    )
    return node


def _has_node(session: Session, address: str) -> bool:
    """Whether a node (of any cluster on this database, nodes not yet flushed included) has
    ``address``."""
    return session.scalars(select(Node.id).where(Node.address == address).limit(1)).first() is not None


FAILED_PREFIX = "Node failed: "


def fail_node(
    session: Session, cluster: Cluster, node: Node, now: datetime, reason: str, *, ids: Ids
) -> None:
    """Mark a node failed, with the reason in its status and an Error event. One that failed before
    its agent ever registered adds to its slot's failures in a row (hyperpod_sim/domain/nodes/recovery.py);
    one whose agent did ends them."""
    node.failed_in_a_row = node.failed_in_a_row + 1 if node.last_heartbeat is None else 0
    node.status_message = f"{FAILED_PREFIX}{reason}."
    events.move(
        session,
        node,
        NodeStatus.FAILURE,
        ids=ids,
        now=now,
        level=Level.ERROR,
        description=f"Node {node.id} failed: {reason}.",
    )
