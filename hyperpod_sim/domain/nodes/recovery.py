"""Bounded failure loops: what the reconciler does when a node's agent cannot be started, and when
a slot's replacements keep failing (docs/node-operations.md, "When a node's agent cannot start").

- **Start attempts.** An agent that cannot be spawned (a missing or non-executable agent command:
  the launch's ``OSError``) or that exits before it registers is started again on the same node
  after START_BACKOFF_S, doubling up to START_BACKOFF_MAX_S; after ``attempts`` failed starts in a
  row the node fails, its status message saying why. The count and the next attempt's time are
  the node's (``start_failures``, ``next_start_at``): a restarted control plane resumes them.
  Registration ends the count.
- **Replacements in a row.** A node that fails before its agent ever registered failed right away;
  each node of a slot hands the count of such failures in a row to its replacement
  (``failed_in_a_row``), and a node whose agent registered ends it. A failed node whose count is
  past ``limit`` is not replaced: the automatic recovery of its group stops
  (``InstanceGroup.recovery_stopped``), which the cluster says in an Error event and its
  ``FailureMessage``; a Creating cluster is Failed then (its creation cannot finish). UpdateCluster
  naming the group, or BatchReplaceClusterNodes of one of its nodes, resumes it (``resume``).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LEAVING, ClusterStatus, GroupStatus, NodeStatus
from hyperpod_sim.domain.nodes.node_set import FAILED_PREFIX, fail_node
from hyperpod_sim.models import Cluster, InstanceGroup, Node

START_BACKOFF_S = 1.0
START_BACKOFF_MAX_S = 30.0

#: Why an agent that was spawned exited before it registered.
EXITED = "its agent exited before it registered"


def start_failed(
    session: Session, cluster: Cluster, node: Node, now: datetime, reason: str, *, ids: Ids, attempts: int
) -> None:
    """The node's agent could not be started (``reason``): its next attempt after a backoff, or,
    at the ``attempts``-th failure in a row, the node fails."""
    if node.status in LEAVING or node.status == NodeStatus.FAILURE:
        return  # deleted, moved away or failed meanwhile: nothing to start
    node.start_failures += 1
    tried = f"attempt {node.start_failures} of {attempts}"
    if node.start_failures >= attempts:
        node.next_start_at = None
        fail_node(session, cluster, node, now, f"{reason} ({tried})", ids=ids)
        return
    delay = min(START_BACKOFF_S * 2 ** (node.start_failures - 1), START_BACKOFF_MAX_S)
    node.next_start_at = now + timedelta(seconds=delay)
    node.status_message = f"{reason[0].upper()}{reason[1:]} ({tried}); starting it again in {delay:g} s."
    events.node_event(
        session,
        node,
        f"Node {node.id}: {reason} ({tried}); starting it again in {delay:g} s.",
        ids=ids,
        now=now,
        level=Level.WARN,
    )


def started(node: Node) -> None:
    """The node's agent process started: no attempt waits (the count goes on until it registers)."""
    node.next_start_at = None


def registered(node: Node) -> None:
    """The node's agent registered: its start attempts are over, and so is its message about them."""
    if node.start_failures and node.status != NodeStatus.FAILURE:
        node.status_message = None
    node.start_failures = 0
    node.next_start_at = None


def stopped(cluster: Cluster, node: Node) -> bool:
    """Whether the automatic recovery of the failed ``node``'s group is stopped."""
    group = _group(cluster, node.group_name)
    return group is not None and group.recovery_stopped is not None


def past_limit(node: Node, limit: int) -> bool:
    """Whether replacing the failed ``node`` would be one replacement too many in a row."""
    return node.failed_in_a_row > limit


def stop(session: Session, cluster: Cluster, node: Node, now: datetime, *, ids: Ids, limit: int) -> bool:
    """Stop the automatic recovery of the failed ``node``'s group: the node stays failed, and the
    cluster says why (an Error event, its FailureMessage); a Creating cluster is Failed. False
    if its group is gone or going (the node just shuts down)."""
    group = _group(cluster, node.group_name)
    if group is None or group.status == GroupStatus.DELETING:
        return False
    cause = (node.status_message or "").removeprefix(FAILED_PREFIX).rstrip(".")
    # A cluster whose creation cannot finish is Failed: nothing but DeleteCluster is left to it.
    failed = cluster.status in (ClusterStatus.CREATING, ClusterStatus.FAILED)
    message = (
        f"Automatic node recovery of instance group '{group.name}' stopped: the node in its slot "
        f"{node.slot} failed before its agent registered {node.failed_in_a_row} times in a row "
        f"({limit} replacement{'' if limit == 1 else 's'}), the last time {node.id}: {cause}."
    )
    if not failed:
        message += (
            " UpdateCluster naming the group, or BatchReplaceClusterNodes of its failed nodes, resumes it."
        )
    group.recovery_stopped = message
    cluster.failure_message = failure_message(cluster)
    kept = "Not replaced: the automatic recovery of its group stopped."
    node.status_message = f"{node.status_message} {kept}" if node.status_message else kept
    if group.status == GroupStatus.CREATING:
        events.move(session, group, GroupStatus.FAILED, ids=ids, now=now)
    if cluster.status == ClusterStatus.CREATING:
        events.move(
            session,
            cluster,
            ClusterStatus.FAILED,
            ids=ids,
            now=now,
            level=Level.ERROR,
            description=f"Cluster creation failed: {message}",
        )
    else:
        events.record(session, ids=ids, now=now, cluster=cluster, level=Level.ERROR, description=message)
    return True


def resume(
    session: Session, cluster: Cluster, group_names: Iterable[str], now: datetime, *, ids: Ids, by: str
) -> None:
    """The user acted on the groups ``group_names`` (``by``: the request): those whose automatic
    recovery stopped replace their failed nodes again, each slot's count in a row from zero."""
    names = set(group_names)
    for group in cluster.instance_groups:
        if group.name not in names or group.recovery_stopped is None:
            continue
        group.recovery_stopped = None
        for node in cluster.nodes:
            if node.group_name == group.name:
                node.failed_in_a_row = 0
        events.record(
            session,
            ids=ids,
            now=now,
            cluster=cluster,
            group_name=group.name,
            description=f"Automatic node recovery of instance group '{group.name}' resumes ({by}).",
        )
    cluster.failure_message = failure_message(cluster)


def failure_message(cluster: Cluster) -> str | None:
    """The cluster's FailureMessage: why the recovery of each group that stopped did."""
    stopped = [g.recovery_stopped for g in cluster.instance_groups if g.recovery_stopped]
    return " ".join(stopped) or None


def _group(cluster: Cluster, name: str) -> InstanceGroup | None:
    return next((g for g in cluster.instance_groups if g.name == name), None)
