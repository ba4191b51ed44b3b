"""StartClusterHealthCheck through boto3, on simulated nodes on the manual clock, with the
DeepHealthCheckFailure fault (hyperpod_sim/domain/faults.py) making a node fail its checks."""

from __future__ import annotations

from typing import Any

import httpx

from hyperpod_sim.domain.node_operations.health_checks import DEEP_HEALTH_CHECK_S
from tests.clusters import error_of, in_service
from tests.conftest import ControlPlane, group, wait_for
from tests.node_operations import settle_nodes, statuses, texts

CHECKS = ["InstanceStress", "InstanceConnectivity"]


def start(sm: Any, name: str, **config: Any) -> None:
    sm.start_cluster_health_check(
        ClusterName=name,
        DeepHealthCheckConfigurations=[
            {"InstanceGroupName": "workers", "DeepHealthChecks": CHECKS, **config}
        ],
    )


def fail_checks(cp: ControlPlane, name: str, node_id: str) -> dict[str, Any]:
    response = httpx.post(
        f"{cp.url}/clusters/{name}/faults", json={"Type": "DeepHealthCheckFailure", "InstanceId": node_id}
    )
    assert response.status_code == 201, response.text
    fault: dict[str, Any] = response.json()
    return fault


def test_healthy_nodes_pass_and_run_again(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "ok", group(count=2))
    start(sm, "ok")
    assert set(statuses(sm, "ok").values()) == {"DeepHealthCheckInProgress"}
    assert sm.describe_cluster(ClusterName="ok")["ClusterStatus"] == "InService"
    control_plane.advance(DEEP_HEALTH_CHECK_S)
    wait_for(lambda: set(statuses(sm, "ok").values()) == {"Running"}, timeout=10, what="the checks to pass")
    for node in statuses(sm, "ok"):
        assert texts(sm, "ok", node)[-2:] == [
            f"Deep health checks started on node {node}: InstanceStress, InstanceConnectivity.",
            f"Node {node} passed its deep health checks (InstanceStress, InstanceConnectivity).",
        ]


def test_a_node_that_fails_is_replaced(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "bad", group(count=2))
    bad, good = sorted(statuses(sm, "bad"))
    fault = fail_checks(control_plane, "bad", bad)
    control_plane.advance(1)  # (its event before the checks' own)
    start(sm, "bad", InstanceIds=[bad])
    assert statuses(sm, "bad") == {bad: "DeepHealthCheckInProgress", good: "Running"}
    control_plane.advance(DEEP_HEALTH_CHECK_S)
    current = settle_nodes(control_plane, sm, "bad", 2)
    assert bad not in current
    assert good in current
    last = texts(sm, "bad", bad)[-3:]  # the last two at one time: in event id order
    assert last[0] == f"Deep health checks started on node {bad}: InstanceStress, InstanceConnectivity."
    assert sorted(last[1:]) == [
        f"Node {bad} failed: it failed its deep health checks (InstanceStress, InstanceConnectivity).",
        f"Node {bad} is replaced after its failed deep health checks (NodeRecovery: Automatic): a new "
        "instance on fresh hardware takes its slot.",
    ]
    ended = httpx.get(f"{control_plane.url}/clusters/bad/faults").json()["Faults"]
    assert ended == [], fault


def test_without_automatic_recovery_a_failed_node_stays_failed(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "man", group(count=1), NodeRecovery="None")
    (node,) = statuses(sm, "man")
    fail_checks(control_plane, "man", node)
    start(sm, "man")
    control_plane.advance(DEEP_HEALTH_CHECK_S)
    wait_for(lambda: statuses(sm, "man") == {node: "Failure"}, timeout=10, what="the node to fail")
    # The operator replaces it (or reboots it, once the fault is cleared).
    assert sm.batch_replace_cluster_nodes(ClusterName="man", NodeIds=[node])["Successful"] == [node]


def test_validation(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "v", group(count=1))
    (node,) = statuses(sm, "v")
    call = sm.start_cluster_health_check
    configs = [{"InstanceGroupName": "nope", "DeepHealthChecks": CHECKS}]
    assert error_of(call, ClusterName="v", DeepHealthCheckConfigurations=configs) == (
        "ValidationException",
        "Instance group 'nope' does not exist in cluster 'v'.",
    )
    configs = [
        {"InstanceGroupName": "workers", "InstanceIds": ["i-0123456789abcdef0"], "DeepHealthChecks": CHECKS}
    ]
    assert error_of(call, ClusterName="v", DeepHealthCheckConfigurations=configs) == (
        "ValidationException",
        "Node i-0123456789abcdef0 is not part of instance group 'workers'.",
    )
    assert error_of(call, ClusterName="gone", DeepHealthCheckConfigurations=configs)[0] == "ResourceNotFound"
    start(sm, "v")
    assert error_of(
        call, ClusterName="v", DeepHealthCheckConfigurations=[configs[0] | {"InstanceIds": [node]}]
    ) == (
        "ValidationException",
        f"Node {node} is DeepHealthCheckInProgress; deep health checks run on Running nodes only.",
    )
