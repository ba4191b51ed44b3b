"""The node operations' tests on simulated nodes (reboot, replace, add, move, software updates):
a cluster's nodes and their statuses and events, two clusters to move nodes between."""

from __future__ import annotations

from typing import Any

from tests.clusters import in_service
from tests.conftest import EKS, ControlPlane, group, wait_for

MISSING = "i-0123456789abcdef0"


def nodes(sm: Any, name: str) -> dict[str, dict[str, Any]]:
    summaries = sm.list_cluster_nodes(ClusterName=name, IncludeNodeLogicalIds=True)["ClusterNodeSummaries"]
    return {n["InstanceId"]: n for n in summaries}


def statuses(sm: Any, name: str) -> dict[str, str]:
    return {node_id: n["InstanceStatus"]["Status"] for node_id, n in nodes(sm, name).items()}


def texts(sm: Any, name: str, node_id: str) -> list[str]:
    found = sm.list_cluster_events(ClusterName=name, NodeId=node_id, SortOrder="Ascending")["Events"]
    return [e["Description"] for e in found]


def settle_nodes(cp: ControlPlane, sm: Any, name: str, count: int) -> dict[str, str]:
    """Advance the clock until ``count`` nodes run and nothing else is there."""

    def check() -> dict[str, str] | None:
        cp.advance(60)
        current = statuses(sm, name)
        return current if list(current.values()) == ["Running"] * count else None

    result: dict[str, str] = wait_for(check, timeout=30, what=f"{count} Running nodes in {name}")
    return result


CONTINUOUS = {"Orchestrator": EKS, "NodeProvisioningMode": "Continuous"}


def arn(sm: Any, name: str) -> str:
    value: str = sm.describe_cluster(ClusterName=name)["ClusterArn"]
    return value


def two_clusters(cp: ControlPlane, sm: Any, *, source: int = 3, minimum: int | None = None) -> None:
    """``src``: workers (``source`` nodes) and a small group of another instance type; ``dst``:
    workers (1 node). Both EKS, Continuous."""
    extra = {} if minimum is None else {"MinInstanceCount": minimum}
    in_service(
        cp, sm, "src", group("workers", source, **extra), group("small", 1, "ml.g5.xlarge"), **CONTINUOUS
    )
    in_service(cp, sm, "dst", group("workers", 1), **CONTINUOUS)


def where(
    sm: Any, source_group: str = "workers", target: str = "dst", target_group: str = "workers"
) -> dict[str, Any]:
    return {
        "SourceClusterArn": arn(sm, "src"),
        "SourceInstanceGroupName": source_group,
        "TargetClusterArn": arn(sm, target),
        "TargetInstanceGroupName": target_group,
    }


def status(sm: Any, name: str, node_id: str) -> str:
    found: str = sm.describe_cluster_node(ClusterName=name, NodeId=node_id)["NodeDetails"]["InstanceStatus"][
        "Status"
    ]
    return found


def arrive(cp: ControlPlane, sm: Any, node_id: str) -> None:
    """Let the detach (the launch delay) pass until the node is in ``dst``."""

    def there() -> bool:
        cp.advance(60)
        return node_id in statuses(sm, "dst")

    # Generous: each poll is several requests, and a loaded CI machine answers them slowly.
    wait_for(there, timeout=90, what=f"{node_id} in dst", explain=lambda: statuses(sm, "src"))


def workers(sm: Any, name: str) -> list[str]:
    return sorted(n for n, s in nodes(sm, name).items() if s["InstanceGroupName"] == "workers")
