"""The whole cluster lifecycle through boto3 over real HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import EKS, ControlPlane, group, status_of, wait_for, wait_gone


def node_ids(sm: Any, name: str) -> list[str]:
    paginator = sm.get_paginator("list_cluster_nodes")
    return [
        node["InstanceId"]
        for page in paginator.paginate(ClusterName=name)
        for node in page["ClusterNodeSummaries"]
    ]


def test_create_update_delete(control_plane: ControlPlane, sm: Any) -> None:
    arn = sm.create_cluster(
        ClusterName="train",
        InstanceGroups=[group("workers", 3), group("ctl", 1, "ml.m5.xlarge")],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 30},
        NodeRecovery="Automatic",
        VpcConfig={"SecurityGroupIds": ["sg-0123456789"], "Subnets": ["subnet-0123456789"]},
        Tags=[{"Key": "team", "Value": "research"}],
    )["ClusterArn"]
    assert arn.startswith("arn:aws:sagemaker:us-east-1:123456789012:cluster/")
    cluster_id = arn.rsplit("/", 1)[1]
    assert len(cluster_id) == 12
    assert cluster_id.isalnum()
    assert cluster_id == cluster_id.lower()

    described = sm.describe_cluster(ClusterName="train")
    assert described["ClusterStatus"] == "Creating"
    assert described["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 30}
    assert described["Orchestrator"] == EKS
    assert described["VpcConfig"]["Subnets"] == ["subnet-0123456789"]
    assert described["NodeRecovery"] == "Automatic"
    assert described["CreationTime"].tzinfo is not None

    described = control_plane.settle(sm, "train")
    counts = {
        g["InstanceGroupName"]: (g["CurrentCount"], g["TargetCount"], g["Status"])
        for g in described["InstanceGroups"]
    }
    assert counts == {"workers": (3, 3, "InService"), "ctl": (1, 1, "InService")}
    # Describe by ARN answers the same cluster.
    assert sm.describe_cluster(ClusterName=arn)["ClusterName"] == "train"

    nodes = node_ids(sm, "train")
    assert len(nodes) == 4
    assert all(n.startswith("i-") and len(n) == 19 for n in nodes)

    sm.update_cluster(
        ClusterName="train",
        InstanceGroups=[group("workers", 5)],
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 50},
    )
    described = sm.describe_cluster(ClusterName="train")
    assert described["ClusterStatus"] == "Updating"
    assert described["TieredStorageConfig"]["InstanceMemoryAllocationPercentage"] == 50
    described = control_plane.settle(sm, "train")
    workers = next(g for g in described["InstanceGroups"] if g["InstanceGroupName"] == "workers")
    assert (workers["CurrentCount"], workers["TargetCount"]) == (5, 5)
    assert len(node_ids(sm, "train")) == 6

    # Deleting nodes lowers their group's target; the cluster stays InService.
    victims = node_ids(sm, "train")[:2]
    result = sm.batch_delete_cluster_nodes(ClusterName="train", NodeIds=[*victims, "i-0123456789abcdef0"])
    assert sorted(result["Successful"]) == sorted(victims)
    assert result["Failed"] == [
        {
            "Code": "NodeIdNotFound",
            "Message": "Node i-0123456789abcdef0 is not part of cluster 'train'.",
            "NodeId": "i-0123456789abcdef0",
        }
    ]
    control_plane.services.reconciler.wake()
    wait_for(lambda: len(node_ids(sm, "train")) == 4, what="deleted nodes to go")
    assert set(victims).isdisjoint(node_ids(sm, "train"))
    assert status_of(sm, "train") == "InService"
    targets = sum(g["TargetCount"] for g in sm.describe_cluster(ClusterName="train")["InstanceGroups"])
    assert targets == 4

    sm.delete_cluster(ClusterName="train")
    wait_gone(sm, "train")
    with pytest.raises(sm.exceptions.ResourceNotFound) as err:
        sm.describe_cluster(ClusterName="train")
    assert err.value.response["Error"]["Message"] == "Cluster 'train' does not exist."
    assert sm.list_clusters()["ClusterSummaries"] == []


def test_scale_down_and_group_deletion(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c1", InstanceGroups=[group("a", 3), group("b", 2)])
    control_plane.settle(sm, "c1")
    sm.update_cluster(ClusterName="c1", InstanceGroups=[group("a", 1)], InstanceGroupsToDelete=["b"])
    described = control_plane.settle(sm, "c1")
    assert [(g["InstanceGroupName"], g["CurrentCount"]) for g in described["InstanceGroups"]] == [("a", 1)]
    nodes = sm.list_cluster_nodes(ClusterName="c1")["ClusterNodeSummaries"]
    assert [n["InstanceGroupName"] for n in nodes] == ["a"]


def test_describe_cluster_node(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(
        ClusterName="c2",
        InstanceGroups=[
            group(
                "a",
                1,
                LifeCycleConfig={"SourceS3Uri": "s3://bucket/lc/", "OnCreate": "on_create.sh"},
                ThreadsPerCore=2,
            )
        ],
    )
    control_plane.settle(sm, "c2")
    summary = sm.list_cluster_nodes(ClusterName="c2", IncludeNodeLogicalIds=True)["ClusterNodeSummaries"][0]
    details = sm.describe_cluster_node(ClusterName="c2", NodeId=summary["InstanceId"])["NodeDetails"]
    assert details["InstanceId"] == summary["InstanceId"]
    assert details["InstanceStatus"] == {"Status": "Running"}
    assert details["LifeCycleConfig"] == {"SourceS3Uri": "s3://bucket/lc/", "OnCreate": "on_create.sh"}
    assert details["ThreadsPerCore"] == 2
    assert details["PrivateDnsHostname"] == f"ip-{details['PrivatePrimaryIp'].replace('.', '-')}.ec2.internal"
    by_logical = sm.describe_cluster_node(ClusterName="c2", NodeLogicalId=summary["NodeLogicalId"])
    assert by_logical["NodeDetails"]["InstanceId"] == summary["InstanceId"]
    with pytest.raises(sm.exceptions.ResourceNotFound):
        sm.describe_cluster_node(ClusterName="c2", NodeId="i-0123456789abcdef0")
