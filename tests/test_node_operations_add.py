"""BatchAddClusterNodes through boto3, on simulated nodes (NodeProvisioningMode: Continuous)."""

from __future__ import annotations

from typing import Any

from tests.conftest import ControlPlane, group
from tests.test_node_operations import nodes, settle_nodes
from tests.test_semantics import error_of, in_service


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
