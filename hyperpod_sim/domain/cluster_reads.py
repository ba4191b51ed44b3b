"""Reads of clusters that several services share: one cluster by name or ARN (``get_cluster``),
DescribeCluster's one-statement read of a cluster with its groups and their Running counts, and
reads behind output members that the cluster service's own reads do not carry: running nodes by
instance type (DescribeCluster's InstanceTypeDetails of a flexible group, one with
InstanceRequirements) and one node by id (DescribeClusterEvent's instance metadata)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, bindparam, func, select
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.interfaces import LoaderOption

from hyperpod_sim.domain.errors import ResourceNotFound
from hyperpod_sim.domain.lifecycle import NodeStatus
from hyperpod_sim.models import Cluster, Database, InstanceGroup, Node

_CLUSTERS = Cluster.__table__
_GROUPS = InstanceGroup.__table__
_NODES = Node.__table__
_GROUP_LABELS = {column.name: f"group_{column.name}" for column in _GROUPS.c}


def _describe_statement(key: Any) -> Any:
    """Cluster row joined with its group rows, each with its Running node count."""
    running = (
        select(func.count())
        .where(
            _NODES.c.cluster_id == _GROUPS.c.cluster_id,
            _NODES.c.group_name == _GROUPS.c.name,
            _NODES.c.status == NodeStatus.RUNNING.value,
        )
        .correlate(_GROUPS)
        .scalar_subquery()
    )
    return (
        select(
            *_CLUSTERS.c,
            *[column.label(_GROUP_LABELS[column.name]) for column in _GROUPS.c],
            running.label("running"),
        )
        .select_from(_CLUSTERS.outerjoin(_GROUPS, _GROUPS.c.cluster_id == _CLUSTERS.c.id))
        .where(key == bindparam("key"))
        .order_by(_GROUPS.c.position)
    )


_DESCRIBE_BY_NAME = _describe_statement(_CLUSTERS.c.name)
_DESCRIBE_BY_ARN = _describe_statement(_CLUSTERS.c.arn)


def by_name_or_arn(name_or_arn: str) -> Select[Cluster]:
    """The query for the cluster a request names, by its name or by its ARN."""
    column = Cluster.arn if name_or_arn.startswith("arn:") else Cluster.name
    return select(Cluster).where(column == name_or_arn)


def get_cluster(session: Session, name_or_arn: str, *loads: LoaderOption, lock: bool = False) -> Cluster:
    """The cluster by name or ARN, with the ``loads`` given (``selectinload(Cluster.nodes)``...),
    locked for update with ``lock``; ``ResourceNotFound`` where there is none."""
    query = by_name_or_arn(name_or_arn).options(*loads)
    if lock:
        query = query.with_for_update()
    cluster = session.scalars(query).one_or_none()
    if cluster is None:
        raise ResourceNotFound(f"Cluster '{name_or_arn}' does not exist.")
    return cluster


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


def locked_cluster(session: Session, name_or_arn: str) -> Cluster:
    """The cluster with its nodes and groups, locked for update (a mutating operation's read)."""
    return get_cluster(
        session, name_or_arn, selectinload(Cluster.nodes), selectinload(Cluster.instance_groups), lock=True
    )


def describe(db: Database, name: str) -> tuple[Cluster, dict[str, int]]:
    """The cluster (detached, with its groups) and its Running nodes per group, in one prepared
    Core statement (DescribeCluster's read, the hottest of the API)."""
    statement = _DESCRIBE_BY_ARN if name.startswith("arn:") else _DESCRIBE_BY_NAME
    with db.connect() as conn:
        rows = conn.execute(statement, {"key": name}).all()
    if not rows:
        raise ResourceNotFound(f"Cluster '{name}' does not exist.")
    first = rows[0]._mapping
    cluster = Cluster(**{column.name: first[column] for column in _CLUSTERS.c})
    groups: list[InstanceGroup] = []
    running: dict[str, int] = {}
    for row in rows:
        mapping = row._mapping
        if mapping[_GROUP_LABELS["id"]] is None:
            continue  # a cluster without groups (all deleted)
        groups.append(InstanceGroup(**{key: mapping[label] for key, label in _GROUP_LABELS.items()}))
        running[mapping[_GROUP_LABELS["name"]]] = mapping["running"]
    cluster.instance_groups = groups
    return cluster, running
