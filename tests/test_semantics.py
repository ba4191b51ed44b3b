"""Semantic rules, error codes, listing and concurrency, through boto3 over real HTTP."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest

from tests.clusters import error_of, in_service
from tests.conftest import EKS, ROLE, ControlPlane, group, status_of

SLURM = {"Slurm": {"SlurmConfigStrategy": "Managed"}}


# ---------------------------------------------------------------------- CreateCluster rules


def test_duplicate_group_names(sm: Any) -> None:
    assert error_of(sm.create_cluster, ClusterName="c", InstanceGroups=[group("a"), group("a", 1)]) == (
        "ValidationException",
        "Instance group name 'a' appears more than once; instance group names must be unique "
        "within a cluster.",
    )


def test_instance_type_xor_requirements(sm: Any) -> None:
    spec = group("a")
    spec["InstanceRequirements"] = {"InstanceTypes": ["ml.p5.48xlarge"]}
    assert error_of(sm.create_cluster, ClusterName="c", InstanceGroups=[spec]) == (
        "ValidationException",
        "Instance group 'a' must specify exactly one of InstanceType or InstanceRequirements.",
    )


@pytest.mark.parametrize("orchestrator", [None, SLURM], ids=["none", "slurm"])
def test_tiered_storage_needs_eks(sm: Any, orchestrator: dict[str, Any] | None) -> None:
    kwargs: dict[str, Any] = {"Orchestrator": orchestrator} if orchestrator else {}
    code, message = error_of(
        sm.create_cluster,
        ClusterName="c",
        InstanceGroups=[group()],
        TieredStorageConfig={"Mode": "Enable"},
        **kwargs,
    )
    assert code == "ValidationException"
    assert message == (
        "TieredStorageConfig with Mode 'Enable' requires an EKS-orchestrated cluster "
        "(Orchestrator.Eks); managed tiered checkpointing is available only on EKS."
    )
    assert sm.list_clusters()["ClusterSummaries"] == [], "nothing half-written"


@pytest.mark.parametrize("percentage", [0, 19])
def test_memory_percentage_range_with_enable(sm: Any, percentage: int) -> None:
    assert error_of(
        sm.create_cluster,
        ClusterName="c",
        InstanceGroups=[group()],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
    ) == (
        "ValidationException",
        f"InstanceMemoryAllocationPercentage {percentage} is out of range: with Mode 'Enable' it "
        "must be between 20 and 100.",
    )


def test_memory_percentage_model_range(raw_sm: Any) -> None:
    code, message = error_of(
        raw_sm.create_cluster,
        ClusterName="c",
        InstanceGroups=[group()],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 101},
    )
    assert (code, message) == (
        "ValidationException",
        "1 validation error detected: Value '101' at "
        "'tieredStorageConfig.instanceMemoryAllocationPercentage' failed to satisfy constraint: "
        "Member must have value less than or equal to 100",
    )


def test_memory_percentage_default_and_disable(sm: Any) -> None:
    sm.create_cluster(
        ClusterName="on", InstanceGroups=[group()], Orchestrator=EKS, TieredStorageConfig={"Mode": "Enable"}
    )
    assert sm.describe_cluster(ClusterName="on")["TieredStorageConfig"] == {
        "Mode": "Enable",
        "InstanceMemoryAllocationPercentage": 20,
    }
    # Disable needs no EKS and ignores the percentage.
    sm.create_cluster(
        ClusterName="off",
        InstanceGroups=[group()],
        TieredStorageConfig={"Mode": "Disable", "InstanceMemoryAllocationPercentage": 0},
    )
    assert sm.describe_cluster(ClusterName="off")["TieredStorageConfig"] == {"Mode": "Disable"}


def test_orchestrator_needs_exactly_one(sm: Any) -> None:
    assert error_of(
        sm.create_cluster, ClusterName="c", InstanceGroups=[group()], Orchestrator={**EKS, **SLURM}
    ) == ("ValidationException", "Orchestrator must specify exactly one of Eks or Slurm.")


def test_name_in_use(sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    assert error_of(sm.create_cluster, ClusterName="c", InstanceGroups=[group()]) == (
        "ResourceInUse",
        "Cluster with name 'c' already exists.",
    )


# ---------------------------------------------------------------------- missing and busy clusters


@pytest.mark.parametrize(
    "operation",
    ["describe_cluster", "delete_cluster", "list_cluster_nodes", "update_cluster"],
)
def test_missing_cluster(sm: Any, operation: str) -> None:
    assert error_of(getattr(sm, operation), ClusterName="nope") == (
        "ResourceNotFound",
        "Cluster 'nope' does not exist.",
    )


def test_conflicts_while_creating_and_updating(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    # The manual clock stands still: the cluster stays Creating.
    assert error_of(sm.update_cluster, ClusterName="c", NodeRecovery="None") == (
        "ConflictException",
        "Cluster 'c' is Creating; UpdateCluster is accepted only while the cluster is InService.",
    )
    assert error_of(sm.delete_cluster, ClusterName="c") == (
        "ConflictException",
        "Cluster 'c' is Creating; DeleteCluster is accepted only while the cluster is InService or Failed.",
    )
    control_plane.settle(sm, "c")
    sm.update_cluster(ClusterName="c", InstanceGroups=[group(count=3)])
    assert status_of(sm, "c") == "Updating"
    assert error_of(sm.update_cluster, ClusterName="c", NodeRecovery="None")[0] == "ConflictException"
    assert error_of(sm.delete_cluster, ClusterName="c")[0] == "ConflictException"
    result = sm.batch_delete_cluster_nodes(
        ClusterName="c",
        NodeIds=[sm.list_cluster_nodes(ClusterName="c")["ClusterNodeSummaries"][0]["InstanceId"]],
    )
    assert result["Failed"][0]["Code"] == "InvalidNodeStatus"
    control_plane.settle(sm, "c")
    assert sum(g["CurrentCount"] for g in sm.describe_cluster(ClusterName="c")["InstanceGroups"]) == 3


def test_concurrent_updates_one_wins(control_plane: ControlPlane) -> None:
    sm = control_plane.client()
    in_service(control_plane, sm, "c", group(count=1))
    for round_ in range(3):
        # Both updates scale to a count the cluster does not have yet, so whichever commits first
        # leaves the cluster Updating (new nodes wait on the manual clock) and the other must lose.
        # A no-op count would let the first finish at once and the second win fairly after it.
        current = sm.describe_cluster(ClusterName="c")["InstanceGroups"][0]["TargetCount"]
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def update(count: int, barrier: threading.Barrier, outcomes: list[str]) -> None:
            client = control_plane.client()
            barrier.wait()
            try:
                client.update_cluster(ClusterName="c", InstanceGroups=[group(count=count)])
                outcomes.append("ok")
            except client.exceptions.ConflictException:
                outcomes.append("conflict")

        threads = [
            threading.Thread(target=update, args=(current + 1 + i, barrier, outcomes)) for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert sorted(outcomes) == ["conflict", "ok"], f"round {round_}: {outcomes}"
        control_plane.settle(sm, "c")


# ---------------------------------------------------------------------- UpdateCluster rules


def test_unknown_group_to_delete(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "c", group("a"), group("b", 1))
    assert error_of(sm.update_cluster, ClusterName="c", InstanceGroupsToDelete=["zz"]) == (
        "ValidationException",
        "InstanceGroupsToDelete names 'zz', which is not an instance group of cluster 'c'. "
        "Its groups are: a, b.",
    )
    assert error_of(
        sm.update_cluster, ClusterName="c", InstanceGroups=[group("a", 3)], InstanceGroupsToDelete=["a"]
    ) == ("ValidationException", "Instance group 'a' is both updated and deleted in one request.")
    assert status_of(sm, "c") == "InService"


def test_instance_type_is_fixed(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "c", group("a"))
    assert error_of(sm.update_cluster, ClusterName="c", InstanceGroups=[group("a", 2, "ml.g5.xlarge")]) == (
        "ValidationException",
        "Instance group 'a' has instance type ml.p5.48xlarge; the instance type of an existing "
        "group cannot change (requested ml.g5.xlarge).",
    )


def test_enable_tiered_storage_on_update(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "slurm", Orchestrator=SLURM)
    assert error_of(sm.update_cluster, ClusterName="slurm", TieredStorageConfig={"Mode": "Enable"})[0] == (
        "ValidationException"
    )
    in_service(control_plane, sm, "eks", Orchestrator=EKS)
    sm.update_cluster(
        ClusterName="eks", TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 60}
    )
    described = control_plane.settle(sm, "eks")
    assert described["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 60}
    sm.update_cluster(ClusterName="eks", TieredStorageConfig={"Mode": "Disable"}, NodeRecovery="None")
    described = control_plane.settle(sm, "eks")
    assert described["TieredStorageConfig"] == {"Mode": "Disable"}
    assert described["NodeRecovery"] == "None"


# ---------------------------------------------------------------------- wire-level validation


def test_validation_names_member_value_and_constraint(raw_sm: Any) -> None:
    name = "x" * 64
    assert error_of(raw_sm.create_cluster, ClusterName=name, InstanceGroups=[group(count=-1)]) == (
        "ValidationException",
        f"2 validation errors detected: Value '{name}' at 'clusterName' failed to satisfy constraint: "
        "Member must have length less than or equal to 63; Value '-1' at "
        "'instanceGroups.1.member.instanceCount' failed to satisfy constraint: Member must have value "
        "greater than or equal to 0",
    )


def test_unknown_member_is_refused(control_plane: ControlPlane) -> None:
    # botocore cannot send a member its model lacks; a newer or hand-written client can.
    response = httpx.post(
        control_plane.url,
        content=json.dumps({"ClusterName": "c", "Verbose": True}),
        headers={"X-Amz-Target": "SageMaker.DescribeCluster", "Content-Type": "application/x-amz-json-1.1"},
    )
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Unknown member 'Verbose' at 'input': allowed members "
        "are ClusterName",
    }


# ---------------------------------------------------------------------- listing


def test_list_clusters_filters_sorting_paging(control_plane: ControlPlane, sm: Any) -> None:
    names = ["delta", "alpha", "charlie", "bravo", "echo"]
    for name in names:
        sm.create_cluster(ClusterName=name, InstanceGroups=[group("g", 1)])
        control_plane.advance(10)  # distinct creation times, in creation order

    def listed(**kwargs: Any) -> list[str]:
        pages = sm.get_paginator("list_clusters").paginate(**kwargs)
        return [c["ClusterName"] for page in pages for c in page["ClusterSummaries"]]

    assert listed() == names  # default: creation time, ascending
    assert listed(SortOrder="Descending") == names[::-1]
    assert listed(SortBy="NAME") == sorted(names)
    assert listed(SortBy="NAME", SortOrder="Descending") == sorted(names, reverse=True)
    assert listed(NameContains="ha") == ["alpha", "charlie"]
    created = {c["ClusterName"]: c["CreationTime"] for c in sm.list_clusters()["ClusterSummaries"]}
    after = created["charlie"] + timedelta(seconds=1)
    assert listed(CreationTimeAfter=after) == ["bravo", "echo"]
    assert listed(CreationTimeBefore=created["charlie"]) == ["delta", "alpha"]
    first = sm.list_clusters(MaxResults=2)
    assert [c["ClusterName"] for c in first["ClusterSummaries"]] == names[:2]
    second = sm.list_clusters(MaxResults=2, NextToken=first["NextToken"])
    assert [c["ClusterName"] for c in second["ClusterSummaries"]] == names[2:4]
    assert listed(PaginationConfig={"PageSize": 2}) == names
    assert error_of(sm.list_clusters, NextToken="garbage") == (
        "ValidationException",
        "Invalid NextToken: pass the NextToken of the previous page of the same request.",
    )


def test_list_cluster_nodes_filters_and_paging(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "c", group("gpu-a", 3), group("cpu", 2, "ml.m5.xlarge"))
    nodes = sm.list_cluster_nodes(ClusterName="c")["ClusterNodeSummaries"]
    assert len(nodes) == 5
    assert all(n["InstanceStatus"]["Status"] == "Running" for n in nodes)
    only_gpu = sm.list_cluster_nodes(ClusterName="c", InstanceGroupNameContains="gpu")
    assert {n["InstanceGroupName"] for n in only_gpu["ClusterNodeSummaries"]} == {"gpu-a"}
    by_name = sm.list_cluster_nodes(ClusterName="c", SortBy="NAME")["ClusterNodeSummaries"]
    assert [n["InstanceGroupName"] for n in by_name] == ["cpu"] * 2 + ["gpu-a"] * 3
    pages = sm.get_paginator("list_cluster_nodes").paginate(ClusterName="c", PaginationConfig={"PageSize": 2})
    ids = [n["InstanceId"] for page in pages for n in page["ClusterNodeSummaries"]]
    assert sorted(ids) == sorted(n["InstanceId"] for n in nodes)
    assert len(set(ids)) == 5
    assert "NodeLogicalId" not in nodes[0]
    with_logical = sm.list_cluster_nodes(ClusterName="c", IncludeNodeLogicalIds=True)
    assert all("NodeLogicalId" in n for n in with_logical["ClusterNodeSummaries"])


# ---------------------------------------------------------------------- tags


def test_tags(sm: Any) -> None:
    arn = sm.create_cluster(ClusterName="c", InstanceGroups=[group()], Tags=[{"Key": "team", "Value": "a"}])[
        "ClusterArn"
    ]
    sm.add_tags(ResourceArn=arn, Tags=[{"Key": "team", "Value": "b"}, {"Key": "env", "Value": "dev"}])
    assert sm.list_tags(ResourceArn=arn)["Tags"] == [
        {"Key": "env", "Value": "dev"},
        {"Key": "team", "Value": "b"},
    ]
    sm.delete_tags(ResourceArn=arn, TagKeys=["team"])
    assert sm.list_tags(ResourceArn=arn)["Tags"] == [{"Key": "env", "Value": "dev"}]
    too_many = [{"Key": f"k{i}", "Value": "v"} for i in range(50)]
    assert error_of(sm.add_tags, ResourceArn=arn, Tags=too_many) == (
        "ValidationException",
        f"Resource '{arn}' would have 51 tags; at most 50 are allowed.",
    )
    job = "arn:aws:sagemaker:us-east-1:123456789012:training-job/j"
    assert error_of(sm.list_tags, ResourceArn=job) == (
        "ValidationException",
        f"Resource '{job}' is not a HyperPod cluster ARN; hyperpod-sim keeps tags for clusters only.",
    )
    missing = "arn:aws:sagemaker:us-east-1:123456789012:cluster/aaaaaaaaaaaa"
    assert error_of(sm.add_tags, ResourceArn=missing, Tags=[{"Key": "a", "Value": "b"}]) == (
        "ValidationException",
        f"Resource '{missing}' does not exist.",
    )


def test_execution_role_is_echoed(control_plane: ControlPlane, sm: Any) -> None:
    in_service(
        control_plane, sm, "c", group("a", 1, ThreadsPerCore=2, OnStartDeepHealthChecks=["InstanceStress"])
    )
    details = sm.describe_cluster(ClusterName="c")["InstanceGroups"][0]
    assert details["ExecutionRole"] == ROLE
    assert details["ThreadsPerCore"] == 2
    assert details["OnStartDeepHealthChecks"] == ["InstanceStress"]
