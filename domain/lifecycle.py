"""Declared status transitions of clusters, instance groups and nodes."""

from __future__ import annotations

from enum import StrEnum

from domain.errors import InternalFailure


class ClusterStatus(StrEnum):
    CREATING = "Creating"
    IN_SERVICE = "InService"
    UPDATING = "Updating"
    DELETING = "Deleting"
    FAILED = "Failed"


class NodeStatus(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    FAILURE = "Failure"
    SHUTTING_DOWN = "ShuttingDown"


class GroupStatus(StrEnum):
    CREATING = "Creating"
    IN_SERVICE = "InService"
    UPDATING = "Updating"
    DELETING = "Deleting"
    DEGRADED = "Degraded"
    FAILED = "Failed"


CLUSTER_TRANSITIONS: dict[ClusterStatus, frozenset[ClusterStatus]] = {
    ClusterStatus.CREATING: frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED}),
    ClusterStatus.IN_SERVICE: frozenset({ClusterStatus.UPDATING, ClusterStatus.DELETING}),
    ClusterStatus.UPDATING: frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED}),
    ClusterStatus.FAILED: frozenset({ClusterStatus.DELETING}),
    # Deleting ends with the row gone.
    ClusterStatus.DELETING: frozenset(),
}

# Statuses in which the cluster accepts UpdateCluster / DeleteCluster / node deletion.
MUTABLE = frozenset({ClusterStatus.IN_SERVICE})
DELETABLE = frozenset({ClusterStatus.IN_SERVICE, ClusterStatus.FAILED})


def check_transition(current: str, target: ClusterStatus) -> ClusterStatus:
    """Return ``target`` if the table allows ``current -> target``; a bug otherwise."""
    source = ClusterStatus(current)
    if target not in CLUSTER_TRANSITIONS[source]:
        raise InternalFailure(f"illegal cluster transition {source} -> {target}")
    return target
