"""Reads behind output members that the cluster service's own reads do not carry: running nodes
by instance type (DescribeCluster's InstanceTypeDetails of a flexible group, one with
InstanceRequirements) and one node by id (DescribeClusterEvent's instance metadata)."""

from __future__ import annotations

from sqlalchemy import func, select

from hyperpod_sim.domain.lifecycle import NodeStatus
from hyperpod_sim.models import Database, Node


def running_by_type(db: Database, *, cluster_id: str) -> dict[str, dict[str, int]]:
    """{group name: {instance type: Running nodes}} for the cluster."""
    query = (
        select(Node.group_name, Node.instance_type, func.count())
        .where(Node.cluster_id == cluster_id, Node.status == NodeStatus.RUNNING.value)
        .group_by(Node.group_name, Node.instance_type)
    )
    counts: dict[str, dict[str, int]] = {}
    with db.read() as session:
        for group_name, instance_type, count in session.execute(query):
            counts.setdefault(group_name, {})[instance_type] = count
    return counts


def find_node(db: Database, *, cluster_id: str, node_id: str) -> Node | None:
    """The cluster's node ``node_id`` (detached), or None when it is gone."""
    with db.read() as session:
        node = session.get(Node, node_id)
        return node if node is not None and node.cluster_id == cluster_id else None
