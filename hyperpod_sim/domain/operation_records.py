"""Cluster operation records: what DescribeClusterOperation and ListClusterOperations return.

An operation is recorded by the request that starts it, in that request's transaction
(:func:`start_operation`), and ends Done when the reconciler sees its work finished
(:func:`settle`), or when the request's own code says so (:func:`finish_operation`). A new
operation supersedes the cluster's operation still in progress (status ``Superseded``): HyperPod
does so when a scaling request replaces one under way. While an operation is the cluster's
current one, every event recorded for the cluster carries its id (ListClusterEvents' OperationId).

Who records one: CreateCluster, UpdateCluster and DeleteCluster (``Scaling``, over the groups),
BatchDeleteClusterNodes (``Scaling``, over the deleted nodes), BatchAddClusterNodes (``Scaling``,
over the groups it grew and the nodes it added), BatchRebootClusterNodes,
BatchReplaceClusterNodes, UpdateClusterSoftware and StartClusterHealthCheck (over the nodes they
act on), MoveClusterNodes (one in the source cluster, Done once its nodes have left, and one in the
target cluster, Done once they are Running there). :func:`settle` ends each once its work is done.

Types: the model's ClusterOperationType has ``Scaling`` and ``DeepHealthCheck``; node
operations without a model type use hyperpod-sim's own (``OperationType``), returned as they
are (botocore does not check an output enum).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.errors import ResourceNotFound
from hyperpod_sim.domain.lifecycle import LEAVING, ClusterStatus, NodeStatus
from hyperpod_sim.domain.pages import Page, paginate
from hyperpod_sim.models import Cluster, ClusterEvent, ClusterOperation, Database, InstanceGroup, Node
from hyperpod_sim.models.software_update import (
    HealthCheckConfiguration,
    OperationDetails,
    ScalingCounts,
    ScalingDetail,
)


class OperationType(StrEnum):
    SCALING = "Scaling"
    DEEP_HEALTH_CHECK = "DeepHealthCheck"
    # hyperpod-sim's own, for node operations the model's enum has no type for.
    REBOOT = "Reboot"
    REPLACE = "Replace"
    SOFTWARE_UPDATE = "SoftwareUpdate"
    MOVE = "Move"


class OperationStatus(StrEnum):
    IN_PROGRESS = "InProgress"
    SUPERSEDED = "Superseded"
    DONE = "Done"


def scaling_details(
    groups: Iterable[InstanceGroup],
    *,
    current: dict[str, int],
    original: dict[str, int],
    desired: dict[str, int] | None = None,
) -> list[ScalingDetail]:
    """ScalingDetails for ``groups``: their Original counts (``current``: live nodes per group
    before the operation, ``original``: targets before it; absent: 0) and Desired target
    (``desired``; absent: the group's target now), by group name."""
    details = []
    for group in groups:
        minimum = group.spec.min_instance_count
        target = (desired or {}).get(group.name, group.target_count)
        details.append(
            ScalingDetail(
                instance_group_name=group.name,
                status=OperationStatus.IN_PROGRESS.value,
                original=ScalingCounts(
                    target_count=original.get(group.name, 0),
                    current_count=current.get(group.name, 0),
                    min_count=minimum,
                ),
                desired=ScalingCounts(target_count=target, min_count=minimum),
            )
        )
    return details


def live_counts(session: Session, cluster: Cluster) -> dict[str, int]:
    """Live nodes (not shutting down, not moving away) per group name, counted by the database
    (an UpdateCluster of a large cluster loads none of its nodes)."""
    rows = session.execute(
        select(Node.group_name, func.count())
        .where(Node.cluster_id == cluster.id, Node.status.not_in(list(LEAVING)))
        .group_by(Node.group_name)
    )
    return {group: count for group, count in rows}


def start_operation(
    session: Session,
    *,
    ids: Ids,
    now: datetime,
    cluster: Cluster,
    type: OperationType,
    requested_by: str,
    node_ids: Sequence[str] = (),
    scaling: list[ScalingDetail] | None = None,
    health_checks: list[HealthCheckConfiguration] | None = None,
    move: dict[str, Any] | None = None,
) -> ClusterOperation:
    """Record a new operation on ``cluster``, in progress, in the caller's transaction (the
    cluster row locked by the caller), and make it the cluster's current one: the operation
    still in progress before it is Superseded.

    ``type``: an OperationType; ``requested_by``: the API operation's name (e.g.
    ``"BatchRebootClusterNodes"``); ``node_ids``: the nodes it acts on (settle() ends it once
    none of them is shutting down any more, with the cluster InService); ``scaling``: its
    ScalingDetails (see scaling_details); ``health_checks``: its DeepHealthCheckDetails (each
    group's checks and the nodes chosen for them); ``move``: a
    MoveClusterNodes request's ClientToken, parameters and answer (kept, not returned: a retry with
    the token answers the same, domain/node_operations/move.py). Returns the
    record; its ``id`` is the OperationId. Events of the cluster recorded earlier in the same
    transaction (the request's own) carry its id too.
    """
    if cluster.operation_id is not None:
        previous = session.get(ClusterOperation, cluster.operation_id)
        if previous is not None and previous.status == OperationStatus.IN_PROGRESS:
            _end(previous, OperationStatus.SUPERSEDED, now)
    details = OperationDetails(scaling_details=scaling, deep_health_check_details=health_checks, move=move)
    operation = ClusterOperation(
        id=ids.event_id(),
        cluster_id=cluster.id,
        type=type.value,
        status=OperationStatus.IN_PROGRESS.value,
        requested_by=requested_by,
        creation_time=now,
        end_time=None,
        node_ids=list(node_ids),
        details=details,
    )
    session.add(operation)
    cluster.operation_id = operation.id
    for pending in session.new:  # the request's own events, recorded before it started
        if (
            isinstance(pending, ClusterEvent)
            and pending.cluster_id == cluster.id
            and pending.operation_id is None
        ):
            pending.operation_id = operation.id
    return operation


def record_scaling(
    session: Session,
    *,
    ids: Ids,
    now: datetime,
    cluster: Cluster,
    requested_by: str,
    current: dict[str, int],
    original: dict[str, int],
    desired: dict[str, int] | None = None,
    groups: list[InstanceGroup] | None = None,
    node_ids: Sequence[str] = (),
) -> ClusterOperation:
    """A Scaling operation over ``groups`` (None: all the cluster's), see scaling_details."""
    return start_operation(
        session,
        ids=ids,
        now=now,
        cluster=cluster,
        type=OperationType.SCALING,
        requested_by=requested_by,
        node_ids=node_ids,
        scaling=scaling_details(
            cluster.instance_groups if groups is None else groups,
            current=current,
            original=original,
            desired=desired,
        ),
    )


def finish_operation(
    session: Session,
    *,
    now: datetime,
    cluster: Cluster,
    operation_id: str | None = None,
) -> ClusterOperation | None:
    """End an operation in progress as Done, in the caller's transaction: ``operation_id``, or
    the cluster's current one when None. Returns it (None: no such operation in progress)."""
    wanted = operation_id or cluster.operation_id
    if wanted is None:
        return None
    operation = session.get(ClusterOperation, wanted)
    if operation is None or operation.status != OperationStatus.IN_PROGRESS:
        return None
    _end(operation, OperationStatus.DONE, now)
    if cluster.operation_id == operation.id:
        cluster.operation_id = None
    return operation


def _end(operation: ClusterOperation, status: OperationStatus, now: datetime) -> None:
    operation.status = status.value
    operation.end_time = now
    scaling = operation.details.scaling_details
    if scaling is not None:
        operation.details = operation.details.model_copy(
            update={"scaling_details": [item.model_copy(update={"status": status.value}) for item in scaling]}
        )


def settle(session: Session, *, cluster: Cluster, now: datetime) -> None:
    """The reconciler's last step on a locked cluster: its current operation is Done once the
    cluster is InService and none of the operation's nodes is still shutting down (or, for the
    nodes a Scaling operation added, still Pending)."""
    if cluster.operation_id is None or cluster.status != ClusterStatus.IN_SERVICE:
        return
    operation = session.get(ClusterOperation, cluster.operation_id)
    if operation is None:
        cluster.operation_id = None
        return
    waiting = set(operation.node_ids)
    if operation.type == OperationType.SCALING:
        # (An UpdateCluster's waits on no node: its nodes are not even loaded for it.)
        busy = bool(waiting) and any(
            n.id in waiting and n.status in (NodeStatus.SHUTTING_DOWN, NodeStatus.PENDING)
            for n in cluster.nodes
        )
    else:
        # A node operation (reboot, replace, software update, deep health check) is over once none
        # of its nodes has work left and every node of the cluster is settled: a rebooted node
        # back Running, a replaced one gone and its replacement Running, no batch still updating.
        busy = cluster.software_update is not None or any(
            (n.id in waiting and n.pending_action is not None) or n.status in _UNSETTLED
            for n in cluster.nodes
        )
        if operation.type == OperationType.MOVE and not busy:
            # The target cluster's record of a move waits for the nodes still detaching elsewhere.
            busy = _arriving(session, waiting - {n.id for n in cluster.nodes}, cluster)
    if not busy:
        finish_operation(session, now=now, cluster=cluster, operation_id=operation.id)


_UNSETTLED = (
    NodeStatus.PENDING,
    NodeStatus.SHUTTING_DOWN,
    NodeStatus.SYSTEM_UPDATING,
    NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
    NodeStatus.DETACH_IN_PROGRESS,
    NodeStatus.ATTACH_IN_PROGRESS,
)


def _arriving(session: Session, node_ids: set[str], cluster: Cluster) -> bool:
    """Whether any of ``node_ids`` is still detaching from another cluster on its way here."""
    if not node_ids:
        return False
    found = session.scalars(
        select(Node).where(Node.id.in_(node_ids), Node.status == NodeStatus.DETACH_IN_PROGRESS)
    )
    return any(n.move is not None and n.move.target_cluster_id == cluster.id for n in found)


# ---------------------------------------------------------------------- reads


def describe_operation(db: Database, *, name: str, operation_id: str) -> tuple[Cluster, ClusterOperation]:
    with db.read() as session:
        cluster = get_cluster(session, name)
        operation = session.get(ClusterOperation, operation_id)
        if operation is None or operation.cluster_id != cluster.id:
            raise ResourceNotFound(f"Operation '{operation_id}' does not exist in cluster '{cluster.name}'.")
        return cluster, operation


def list_operations(
    db: Database,
    *,
    name: str,
    status: str | None = None,
    type: str | None = None,
    creation_time_after: datetime | None = None,
    creation_time_before: datetime | None = None,
    sort_order: str | None = None,
    max_results: int | None = None,
    next_token: str | None = None,
) -> tuple[Cluster, Page[ClusterOperation]]:
    """The cluster's operations, newest first unless ``sort_order`` is Ascending (the only sort
    key is CreationTime)."""
    with db.read() as session:
        cluster = get_cluster(session, name)
        query = select(ClusterOperation).where(ClusterOperation.cluster_id == cluster.id)
        if status:
            query = query.where(ClusterOperation.status == status)
        if type:
            query = query.where(ClusterOperation.type == type)
        if creation_time_after is not None:
            query = query.where(ClusterOperation.creation_time > creation_time_after)
        if creation_time_before is not None:
            query = query.where(ClusterOperation.creation_time < creation_time_before)
        if sort_order == "Ascending":
            query = query.order_by(ClusterOperation.creation_time.asc(), ClusterOperation.id.asc())
        else:
            query = query.order_by(ClusterOperation.creation_time.desc(), ClusterOperation.id.desc())
        found = list(session.scalars(query))
    scope = f"operations:{cluster.id}:{status}:{type}:{sort_order}"
    return cluster, paginate(found, max_results=max_results, token=next_token, scope=scope)
