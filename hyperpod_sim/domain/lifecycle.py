"""Declared status transitions of clusters, instance groups, nodes and instance groups' software
updates, and the policy generation.

Every status change goes through ``check_transition`` (``events.move`` calls it and records the
change's event): a move that its table does not list is a bug, raised as ``InternalFailure``. A
status that stays what it is is no move and is always allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TypeVar

from hyperpod_sim.domain.errors import InternalFailure
from hyperpod_sim.models import Cluster


class ClusterStatus(StrEnum):
    CREATING = "Creating"
    IN_SERVICE = "InService"
    UPDATING = "Updating"
    DELETING = "Deleting"
    FAILED = "Failed"
    # UpdateClusterSoftware rolls through the nodes (domain/node_operations/software_update.py).
    SYSTEM_UPDATING = "SystemUpdating"


class NodeStatus(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    FAILURE = "Failure"
    SHUTTING_DOWN = "ShuttingDown"
    # Its batch of a rolling software update: its agent stopped, its memory cleared, started again.
    SYSTEM_UPDATING = "SystemUpdating"
    # StartClusterHealthCheck runs its deep health checks (domain/node_operations/health_checks.py).
    DEEP_HEALTH_CHECK_IN_PROGRESS = "DeepHealthCheckInProgress"
    # MoveClusterNodes (domain/node_operations/move.py): in its source group while its agent stops, then in
    # the target group until its new agent has registered there and applied the target's policy.
    DETACH_IN_PROGRESS = "DetachInProgress"
    ATTACH_IN_PROGRESS = "AttachInProgress"


class GroupStatus(StrEnum):
    CREATING = "Creating"
    IN_SERVICE = "InService"
    UPDATING = "Updating"
    DELETING = "Deleting"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class SoftwareUpdateStatus(StrEnum):
    """An instance group's last software update (DescribeCluster's SoftwareUpdateStatus)."""

    PENDING = "Pending"
    IN_PROGRESS = "InProgress"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    ROLLBACK_IN_PROGRESS = "RollbackInProgress"
    ROLLBACK_COMPLETE = "RollbackComplete"


CLUSTER_TRANSITIONS: dict[ClusterStatus, frozenset[ClusterStatus]] = {
    ClusterStatus.CREATING: frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED}),
    ClusterStatus.IN_SERVICE: frozenset(
        {ClusterStatus.UPDATING, ClusterStatus.DELETING, ClusterStatus.SYSTEM_UPDATING}
    ),
    ClusterStatus.UPDATING: frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED}),
    ClusterStatus.SYSTEM_UPDATING: frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED}),
    ClusterStatus.FAILED: frozenset({ClusterStatus.DELETING}),
    # Deleting ends with the row gone.
    ClusterStatus.DELETING: frozenset(),
}

GROUP_TRANSITIONS: dict[GroupStatus, frozenset[GroupStatus]] = {
    # A new group is InService once its cluster is (every node Running with the current policy).
    # Failed with its cluster's creation, when its nodes cannot start (domain/nodes/recovery.py).
    GroupStatus.CREATING: frozenset({GroupStatus.IN_SERVICE, GroupStatus.DELETING, GroupStatus.FAILED}),
    GroupStatus.IN_SERVICE: frozenset({GroupStatus.UPDATING, GroupStatus.DELETING}),
    GroupStatus.UPDATING: frozenset({GroupStatus.IN_SERVICE, GroupStatus.DELETING}),
    GroupStatus.DEGRADED: frozenset({GroupStatus.IN_SERVICE, GroupStatus.UPDATING, GroupStatus.DELETING}),
    GroupStatus.FAILED: frozenset({GroupStatus.DELETING}),
    # Deleting ends with the row gone, once its nodes are.
    GroupStatus.DELETING: frozenset(),
}

NODE_TRANSITIONS: dict[NodeStatus, frozenset[NodeStatus]] = {
    NodeStatus.PENDING: frozenset({NodeStatus.RUNNING, NodeStatus.FAILURE, NodeStatus.SHUTTING_DOWN}),
    # A rebooted node (BatchRebootClusterNodes) is Pending until its agent has registered again
    # and applied the current policy.
    NodeStatus.RUNNING: frozenset(
        {
            NodeStatus.PENDING,
            NodeStatus.FAILURE,
            NodeStatus.SHUTTING_DOWN,
            NodeStatus.SYSTEM_UPDATING,
            NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
            NodeStatus.DETACH_IN_PROGRESS,
        }
    ),
    # Attaching once its agent has stopped (in the target group, or back in its own when the target
    # went meanwhile); shut down with its cluster when that is deleted first.
    NodeStatus.DETACH_IN_PROGRESS: frozenset({NodeStatus.ATTACH_IN_PROGRESS, NodeStatus.SHUTTING_DOWN}),
    # Running once its new agent is back with the target's policy; failed if it does not come back.
    NodeStatus.ATTACH_IN_PROGRESS: frozenset(
        {NodeStatus.RUNNING, NodeStatus.FAILURE, NodeStatus.SHUTTING_DOWN}
    ),
    # Running again when it passes; Failure (then replaced, with NodeRecovery: Automatic) when not.
    NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS: frozenset(
        {NodeStatus.RUNNING, NodeStatus.FAILURE, NodeStatus.SHUTTING_DOWN}
    ),
    # Running again once its agent is back with the current policy; failed if it does not come back.
    NodeStatus.SYSTEM_UPDATING: frozenset({NodeStatus.RUNNING, NodeStatus.FAILURE, NodeStatus.SHUTTING_DOWN}),
    # A failed node whose agent registers or heartbeats again is Pending until it has the policy;
    # one that is replaced (NodeRecovery: Automatic) or deleted shuts down.
    NodeStatus.FAILURE: frozenset({NodeStatus.PENDING, NodeStatus.SHUTTING_DOWN}),
    # ShuttingDown ends with the row gone, once its agent has stopped.
    NodeStatus.SHUTTING_DOWN: frozenset(),
}

# The model's sequences: Pending -> InProgress -> Succeeded, or InProgress -> RollbackInProgress ->
# RollbackComplete | Failed; a group's next update starts again from the last one's end. Here an
# update starts at once (InProgress from the request on, never Pending) and never rolls back (its
# alarms are not monitored), so only InProgress and Succeeded are used.
SOFTWARE_UPDATE_TRANSITIONS: dict[SoftwareUpdateStatus, frozenset[SoftwareUpdateStatus]] = {
    SoftwareUpdateStatus.PENDING: frozenset({SoftwareUpdateStatus.IN_PROGRESS}),
    SoftwareUpdateStatus.IN_PROGRESS: frozenset(
        {SoftwareUpdateStatus.SUCCEEDED, SoftwareUpdateStatus.ROLLBACK_IN_PROGRESS}
    ),
    SoftwareUpdateStatus.ROLLBACK_IN_PROGRESS: frozenset(
        {SoftwareUpdateStatus.ROLLBACK_COMPLETE, SoftwareUpdateStatus.FAILED}
    ),
    **{
        ended: frozenset({SoftwareUpdateStatus.PENDING, SoftwareUpdateStatus.IN_PROGRESS})
        for ended in (
            SoftwareUpdateStatus.SUCCEEDED,
            SoftwareUpdateStatus.ROLLBACK_COMPLETE,
            SoftwareUpdateStatus.FAILED,
        )
    },
}

# A node's statuses while it is a member of its cluster (of the replica ring, of the policy). A
# node being moved away (DetachInProgress) is no longer one; a node moved in (AttachInProgress) is.
LIVE = (
    NodeStatus.PENDING,
    NodeStatus.RUNNING,
    NodeStatus.FAILURE,
    NodeStatus.SYSTEM_UPDATING,
    NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
    NodeStatus.ATTACH_IN_PROGRESS,
)

# Statuses of a node on its way out of its group: it counts towards none of its group's counts.
LEAVING = (NodeStatus.SHUTTING_DOWN, NodeStatus.DETACH_IN_PROGRESS)

# Statuses in which the cluster accepts UpdateCluster / DeleteCluster / node deletion.
MUTABLE = frozenset({ClusterStatus.IN_SERVICE})
DELETABLE = frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED})

S = TypeVar("S", ClusterStatus, GroupStatus, NodeStatus, SoftwareUpdateStatus)


def check_transition(current: str, target: S) -> S:
    """Return ``target`` if its table allows ``current -> target`` (or it is ``current``); a bug
    otherwise."""
    kind, table = _TABLES[type(target)]
    source = type(target)(current)
    if source != target and target not in table[source]:
        raise InternalFailure(f"illegal {kind} transition {source} -> {target}")
    return target


_TABLES: dict[type[StrEnum], tuple[str, Mapping[Any, frozenset[Any]]]] = {
    ClusterStatus: ("cluster", CLUSTER_TRANSITIONS),
    GroupStatus: ("instance group", GROUP_TRANSITIONS),
    NodeStatus: ("node", NODE_TRANSITIONS),
    SoftwareUpdateStatus: ("software update", SOFTWARE_UPDATE_TRANSITIONS),
}


def bump_generation(cluster: Cluster) -> int:
    """A new policy generation for ``cluster`` (its desired state changed: the node set, the
    replica ring, the tiered storage or checkpoint policy, an S3 fault); the reconciler pushes it
    to every node until each has applied it. The new generation."""
    cluster.generation += 1
    return cluster.generation
