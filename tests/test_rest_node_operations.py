"""The node operations' REST routes (reboot, replace, add, software update, deep health check, move)
over raw HTTP, on SQLite and on PostgreSQL: the same answers as the AWS JSON entry, and the
operations they start in the operation records."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from hyperpod_sim.api.rest import ROUTES
from hyperpod_sim.domain.node_operations.health_checks import DEEP_HEALTH_CHECK_S
from tests.conftest import EKS, ControlPlane, group, wait_for
from tests.node_operations import arrive, two_clusters, where, workers
from tests.rest import describe, node_ids, settle, wire

NODE_OPERATIONS = {
    "BatchRebootClusterNodes": ("POST", "/clusters/{name}/nodes/batch-reboot"),
    "BatchReplaceClusterNodes": ("POST", "/clusters/{name}/nodes/batch-replace"),
    "BatchAddClusterNodes": ("POST", "/clusters/{name}/nodes/batch-add"),
    "UpdateClusterSoftware": ("POST", "/clusters/{name}/software-update"),
    "StartClusterHealthCheck": ("POST", "/clusters/{name}/health-checks"),
    "MoveClusterNodes": ("POST", "/cluster-nodes/move"),
    "ListClusterOperations": ("GET", "/clusters/{name}/operations"),
    "DescribeClusterOperation": ("GET", "/clusters/{name}/operations/{operation_id}"),
}


def make(http: httpx.Client, control_plane: ControlPlane, name: str, count: int = 2, **extra: Any) -> None:
    body = {"ClusterName": name, "InstanceGroups": [group("workers", count)], "Orchestrator": EKS, **extra}
    response = http.post("/clusters", json=body)
    assert response.status_code == 200, response.text
    settle(control_plane, http, name)


def statuses(http: httpx.Client, name: str) -> dict[str, str]:
    summaries = http.get(f"/clusters/{name}/nodes").json()["ClusterNodeSummaries"]
    return {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in summaries}


def operations(http: httpx.Client, name: str) -> list[dict[str, Any]]:
    response = http.get(f"/clusters/{name}/operations")
    assert response.status_code == 200, response.text
    summaries: list[dict[str, Any]] = response.json()["ClusterOperationSummaries"]
    return summaries


def test_every_node_operation_has_its_route() -> None:
    routed = {route.operation: (route.method, route.path) for route in ROUTES}
    assert {op: routed.get(op) for op in NODE_OPERATIONS} == NODE_OPERATIONS


def test_reboot_and_replace(control_plane: ControlPlane, http: httpx.Client, sm: Any) -> None:
    make(http, control_plane, "demo", count=3)
    first, second, _ = node_ids(http, "demo")
    missing = "i-0123456789abcdef0"

    rebooted = http.post("/clusters/demo/nodes/batch-reboot", json={"NodeIds": [first, missing]})
    assert rebooted.status_code == 200, rebooted.text
    answer = rebooted.json()
    assert answer["Successful"] == [first]
    assert [(f["NodeId"], f["ErrorCode"]) for f in answer["Failed"]] == [(missing, "InstanceIdNotFound")]
    assert statuses(http, "demo")[first] == "Pending"  # the same node, its agent starting again
    settle(control_plane, http, "demo")

    replaced = http.post("/clusters/demo/nodes/batch-replace", json={"NodeIds": [second]})
    assert replaced.status_code == 200, replaced.text
    assert replaced.json()["Successful"] == [second]
    control_plane.services.reconciler.wake()
    wait_for(lambda: second not in statuses(http, "demo"), what="the replaced node to go")
    settle(control_plane, http, "demo")
    assert len(node_ids(http, "demo")) == 3
    assert first in node_ids(http, "demo")

    # Each is recorded as an operation, the same over REST as over AWS JSON.
    recorded = operations(http, "demo")
    assert {o["Type"] for o in recorded} >= {"Reboot", "Replace"}
    one = recorded[0]["OperationId"]
    described = http.get(f"/clusters/demo/operations/{one}")
    assert described.status_code == 200, described.text
    assert described.json() == wire(sm.describe_cluster_operation(ClusterName="demo", OperationId=one))

    empty = http.post("/clusters/demo/nodes/batch-reboot", json={})
    assert empty.status_code == 400
    assert empty.json()["__type"] == "ValidationException"


def test_batch_add(control_plane: ControlPlane, http: httpx.Client) -> None:
    make(http, control_plane, "cont", count=1, NodeProvisioningMode="Continuous")
    body = {
        "NodesToAdd": [{"InstanceGroupName": "workers", "IncrementTargetCountBy": 2}],
        "ClientToken": "a1",
    }
    response = http.post("/clusters/cont/nodes/batch-add", json=body)
    assert response.status_code == 200, response.text
    added = response.json()
    assert [(a["InstanceGroupName"], a["Status"]) for a in added["Successful"]] == [
        ("workers", "Pending")
    ] * 2
    assert added["Failed"] == []
    # The same token over REST is the same request: nothing more is added.
    again = http.post("/clusters/cont/nodes/batch-add", json=body)
    assert [a["NodeLogicalId"] for a in again.json()["Successful"]] == [
        a["NodeLogicalId"] for a in added["Successful"]
    ]
    assert describe(http, "cont")["InstanceGroups"][0]["TargetCount"] == 3
    settle(control_plane, http, "cont")
    assert len(node_ids(http, "cont")) == 3

    gone = http.post("/clusters/nope/nodes/batch-add", json=body)
    assert gone.status_code == 404
    assert gone.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}


def test_software_update(control_plane: ControlPlane, http: httpx.Client) -> None:
    make(http, control_plane, "sw", count=2)
    policy = {"RollingUpdatePolicy": {"MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": 1}}}
    response = http.post("/clusters/sw/software-update", json={"DeploymentConfig": policy})
    assert response.status_code == 200, response.text
    assert response.json() == {"ClusterArn": describe(http, "sw")["ClusterArn"]}
    (workers,) = describe(http, "sw")["InstanceGroups"]
    assert (workers["SoftwareUpdateStatus"], workers["ImageVersionStatus"]) == (
        "InProgress",
        "UpdateAvailable",
    )
    # A second while the first rolls is a conflict: 409, with AWS's body.
    busy = http.post("/clusters/sw/software-update", json={})
    assert busy.status_code == 409
    assert busy.json() == {
        "__type": "ConflictException",
        "message": "Cluster 'sw' is SystemUpdating; UpdateClusterSoftware is accepted only while the "
        "cluster is InService.",
    }
    settle(control_plane, http, "sw")
    (workers,) = describe(http, "sw")["InstanceGroups"]
    assert (workers["SoftwareUpdateStatus"], workers["CurrentImageReleaseVersion"]) == ("Succeeded", "1.1.0")
    assert "SoftwareUpdate" in {o["Type"] for o in operations(http, "sw")}


def test_health_check(control_plane: ControlPlane, http: httpx.Client) -> None:
    make(http, control_plane, "hc", count=2)
    checks = [{"InstanceGroupName": "workers", "DeepHealthChecks": ["InstanceStress"]}]
    response = http.post("/clusters/hc/health-checks", json={"DeepHealthCheckConfigurations": checks})
    assert response.status_code == 200, response.text
    assert set(statuses(http, "hc").values()) == {"DeepHealthCheckInProgress"}
    control_plane.advance(DEEP_HEALTH_CHECK_S)
    wait_for(lambda: set(statuses(http, "hc").values()) == {"Running"}, what="the checks to pass")
    assert "DeepHealthCheck" in {o["Type"] for o in operations(http, "hc")}

    unknown = [{"InstanceGroupName": "nope", "DeepHealthChecks": ["InstanceStress"]}]
    refused = http.post("/clusters/hc/health-checks", json={"DeepHealthCheckConfigurations": unknown})
    assert refused.status_code == 400
    assert refused.json()["__type"] == "ValidationException"


@pytest.mark.parametrize("operation", [op for op, (method, _) in NODE_OPERATIONS.items() if method == "POST"])
def test_the_documented_example_is_a_request_the_route_takes(http: httpx.Client, operation: str) -> None:
    """Each node operation's OpenAPI example passes validation: on a cluster that does not exist
    it gets as far as the cluster lookup (404), not a 400 about its members."""
    document = http.get("/openapi.json").json()
    method, path = NODE_OPERATIONS[operation]
    documented = document["paths"][path][method.lower()]
    example = documented["requestBody"]["content"]["application/json"]["example"]
    response = http.request(method, path.format(name="nope"), json=example)
    assert response.status_code == 404, response.text


def test_move_through_its_body_only_route(control_plane: ControlPlane, http: httpx.Client, sm: Any) -> None:
    two_clusters(control_plane, sm)
    moved = workers(sm, "src")[0]
    missing = "i-0123456789abcdef0"
    answer = http.post("/cluster-nodes/move", json={**where(sm), "NodeIds": [moved, missing]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["Successful"] == [moved]
    assert [f["NodeId"] for f in answer.json()["Failed"]] == [missing]
    assert statuses(http, "src")[moved] == "DetachInProgress"
    arrive(control_plane, sm, moved)
    assert moved in statuses(http, "dst")
    assert "Move" in {o["Type"] for o in operations(http, "dst")}
    # The AWS shape of an error, as on every route: a cluster that does not exist is a 404.
    target = where(sm)["TargetClusterArn"]
    # A cluster id is random: change its last character to one it is not, so the ARN names no cluster.
    other = "x" if target[-1] != "x" else "y"
    gone = {**where(sm), "TargetClusterArn": target[:-1] + other, "NodeIds": [moved]}
    refused = http.post("/cluster-nodes/move", json=gone)
    assert refused.status_code == 404
    assert refused.json()["__type"] == "ResourceNotFound"
