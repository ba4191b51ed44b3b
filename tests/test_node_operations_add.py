"""BatchAddClusterNodes through boto3, on simulated nodes (NodeProvisioningMode: Continuous)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyperpod_sim.api.app import create_app
from tests.clusters import error_of, in_service
from tests.conftest import (
    ControlPlane,
    ManualClock,
    ServerThread,
    free_port,
    group,
    make_settings,
    sagemaker_client,
    wait_status,
)
from tests.node_operations import nodes, settle_nodes


def test_adds_nodes_with_logical_ids(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "add", group(count=1), NodeProvisioningMode="Continuous")
    answer = sm.batch_add_cluster_nodes(
        ClusterName="add",
        NodesToAdd=[
            {"InstanceGroupName": "workers", "IncrementTargetCountBy": 2},
            {"InstanceGroupName": "nope", "IncrementTargetCountBy": 1},
        ],
    )
    added = answer["Successful"]
    assert [(a["InstanceGroupName"], a["Status"], a["InstanceTypes"]) for a in added] == [
        ("workers", "Pending", ["ml.p5.48xlarge"])
    ] * 2
    assert answer["Failed"] == [
        {
            "InstanceGroupName": "nope",
            "ErrorCode": "InstanceGroupNotFound",
            "FailedCount": 1,
            "Message": "Instance group 'nope' does not exist in cluster 'add'.",
        }
    ]
    # Trackable at once by logical id, and Running after the launch delay; the cluster stays InService.
    for addition in added:
        details = sm.describe_cluster_node(ClusterName="add", NodeLogicalId=addition["NodeLogicalId"])
        assert details["NodeDetails"]["InstanceStatus"]["Status"] == "Pending"
    assert sm.describe_cluster(ClusterName="add")["ClusterStatus"] == "InService"
    settle_nodes(control_plane, sm, "add", 3)
    logical = {n["NodeLogicalId"] for n in nodes(sm, "add").values()}
    assert {a["NodeLogicalId"] for a in added} <= logical
    description = sm.describe_cluster(ClusterName="add")
    assert description["InstanceGroups"][0]["TargetCount"] == 3
    assert description["InstanceGroups"][0]["CurrentCount"] == 3
    events = sm.list_cluster_events(ClusterName="add", ResourceType="InstanceGroup")["Events"]
    assert events[0]["Description"] == (
        "2 nodes added to group workers (BatchAddClusterNodes); its target count is 3."
    )


def test_per_group_refusals(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "g", group(count=1), NodeProvisioningMode="Continuous")
    answer = sm.batch_add_cluster_nodes(
        ClusterName="g",
        NodesToAdd=[
            {"InstanceGroupName": "workers", "IncrementTargetCountBy": 1, "InstanceTypes": ["ml.g5.xlarge"]},
            {
                "InstanceGroupName": "workers",
                "IncrementTargetCountBy": 1,
                "AvailabilityZones": ["us-west-2b"],
            },
        ],
    )
    assert answer["Successful"] == []
    assert [(f["ErrorCode"], f["Message"]) for f in answer["Failed"]] == [
        ("IncompatibleInstanceTypes", "Instance group 'workers' runs ml.p5.48xlarge, not ml.g5.xlarge."),
        (
            "IncompatibleAvailabilityZones",
            "Instance group 'workers' places its nodes in us-east-1a (hyperpod-sim has one availability "
            "zone), not in us-west-2b.",
        ),
    ]


def test_validation(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "plain", group(count=1))
    one = [{"InstanceGroupName": "workers", "IncrementTargetCountBy": 1}]
    assert error_of(sm.batch_add_cluster_nodes, ClusterName="plain", NodesToAdd=one) == (
        "ValidationException",
        "BatchAddClusterNodes is supported only for clusters whose NodeProvisioningMode is Continuous; "
        "cluster 'plain' is not: use UpdateCluster.",
    )
    assert error_of(sm.batch_add_cluster_nodes, ClusterName="gone", NodesToAdd=one)[0] == "ResourceNotFound"
    in_service(control_plane, sm, "cont", group(count=1), NodeProvisioningMode="Continuous")
    many = [{"InstanceGroupName": "workers", "IncrementTargetCountBy": 30}] * 2
    assert error_of(sm.batch_add_cluster_nodes, ClusterName="cont", NodesToAdd=many) == (
        "ValidationException",
        "NodesToAdd adds 60 nodes; at most 50 can be added in one request.",
    )


ONE_MORE = [{"InstanceGroupName": "workers", "IncrementTargetCountBy": 1}]


def test_client_token_answers_a_retry_with_the_first_nodes(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "tok", group(count=1), NodeProvisioningMode="Continuous")
    asked = [*ONE_MORE, {"InstanceGroupName": "nope", "IncrementTargetCountBy": 1}]
    first = sm.batch_add_cluster_nodes(ClusterName="tok", NodesToAdd=asked, ClientToken="retry-1")
    [added] = first["Successful"]
    settle_nodes(control_plane, sm, "tok", 2)
    # The retry adds nothing and answers the same node, with its status now, and the same refusal.
    again = sm.batch_add_cluster_nodes(ClusterName="tok", NodesToAdd=asked, ClientToken="retry-1")
    assert again["Successful"] == [{**added, "Status": "Running"}]
    assert again["Failed"] == first["Failed"]
    assert sm.describe_cluster(ClusterName="tok")["InstanceGroups"][0]["TargetCount"] == 2
    assert len(nodes(sm, "tok")) == 2
    # The token names its request: other parameters with it are refused, and change nothing.
    assert error_of(
        sm.batch_add_cluster_nodes,
        ClusterName="tok",
        NodesToAdd=[{"InstanceGroupName": "workers", "IncrementTargetCountBy": 2}],
        ClientToken="retry-1",
    ) == ("ValidationException", "ClientToken 'retry-1' was used with different parameters.")
    assert len(nodes(sm, "tok")) == 2
    # A node deleted since is answered NotFound.
    sm.batch_delete_cluster_nodes(ClusterName="tok", NodeLogicalIds=[added["NodeLogicalId"]])
    settle_nodes(control_plane, sm, "tok", 1)
    gone = sm.batch_add_cluster_nodes(ClusterName="tok", NodesToAdd=asked, ClientToken="retry-1")
    assert [entry["Status"] for entry in gone["Successful"]] == ["NotFound"]
    # Another token, or none, adds again.
    other = sm.batch_add_cluster_nodes(ClusterName="tok", NodesToAdd=ONE_MORE, ClientToken="retry-2")
    assert other["Successful"][0]["NodeLogicalId"] != added["NodeLogicalId"]


def test_client_token_is_valid_for_8_hours(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "ttl", group(count=1), NodeProvisioningMode="Continuous")
    asked_at = control_plane.clock.now()
    first = sm.batch_add_cluster_nodes(ClusterName="ttl", NodesToAdd=ONE_MORE, ClientToken="t")
    settle_nodes(control_plane, sm, "ttl", 2)
    elapsed = (control_plane.clock.now() - asked_at).total_seconds()
    control_plane.advance(8 * 3600 - elapsed - 1)
    within = sm.batch_add_cluster_nodes(ClusterName="ttl", NodesToAdd=ONE_MORE, ClientToken="t")
    assert within["Successful"][0]["NodeLogicalId"] == first["Successful"][0]["NodeLogicalId"]
    control_plane.advance(1)
    # Past its validity the token is forgotten: the same request adds a node again.
    later = sm.batch_add_cluster_nodes(ClusterName="ttl", NodesToAdd=ONE_MORE, ClientToken="t")
    assert later["Successful"][0]["NodeLogicalId"] != first["Successful"][0]["NodeLogicalId"]
    assert sm.describe_cluster(ClusterName="ttl")["InstanceGroups"][0]["TargetCount"] == 3


def test_client_token_survives_a_restart(database_url: str, tmp_path: Path) -> None:
    settings = make_settings(
        database_url, tmp_path / "data", provisioning={"mode": "simulated", "node_ready_delay_s": 0}
    )
    clock = ManualClock()
    port = free_port()

    def serve() -> ServerThread:
        return ServerThread(create_app(settings, clock=clock), port)

    with serve():
        sm = sagemaker_client(f"http://127.0.0.1:{port}")
        sm.create_cluster(
            ClusterName="kept", InstanceGroups=[group(count=1)], NodeProvisioningMode="Continuous"
        )
        wait_status(sm, "kept", "InService")
        first = sm.batch_add_cluster_nodes(ClusterName="kept", NodesToAdd=ONE_MORE, ClientToken="r")
    with serve():
        again = sm.batch_add_cluster_nodes(ClusterName="kept", NodesToAdd=ONE_MORE, ClientToken="r")
        assert [a["NodeLogicalId"] for a in again["Successful"]] == [
            a["NodeLogicalId"] for a in first["Successful"]
        ]
        assert sm.describe_cluster(ClusterName="kept")["InstanceGroups"][0]["TargetCount"] == 2
