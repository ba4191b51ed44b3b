"""Cluster scheduler configs (task governance's cluster policy) through boto3 over real HTTP, on
SQLite and PostgreSQL: stored, validated, versioned, returned; one per EKS cluster."""

from __future__ import annotations

from typing import Any

import httpx

from tests.clusters import error_of
from tests.conftest import EKS, ControlPlane, group, wait_for

POLICY = {
    "PriorityClasses": [{"Name": "inference", "Weight": 90}, {"Name": "training", "Weight": 50}],
    "FairShare": "Enabled",
    "IdleResourceSharing": "Disabled",
}


def eks_cluster(sm: Any, name: str = "c") -> str:
    arn: str = sm.create_cluster(ClusterName=name, InstanceGroups=[group()], Orchestrator=EKS)["ClusterArn"]
    return arn


def test_create_describe_update_versions_delete(control_plane: ControlPlane, sm: Any) -> None:
    arn = eks_cluster(sm)
    created = sm.create_cluster_scheduler_config(
        Name="policy",
        ClusterArn=arn,
        SchedulerConfig=POLICY,
        Description="first",
        Tags=[{"Key": "t", "Value": "v"}],
    )
    config_id = created["ClusterSchedulerConfigId"]
    assert created["ClusterSchedulerConfigArn"] == (
        f"arn:aws:sagemaker:us-east-1:123456789012:cluster-scheduler-config/{config_id}"
    )
    described = sm.describe_cluster_scheduler_config(ClusterSchedulerConfigId=config_id)
    del described["ResponseMetadata"]
    assert described == {
        "ClusterSchedulerConfigArn": created["ClusterSchedulerConfigArn"],
        "ClusterSchedulerConfigId": config_id,
        "Name": "policy",
        "ClusterSchedulerConfigVersion": 1,
        "Status": "Created",
        "StatusDetails": {
            "PriorityClasses": "Created",
            "FairShare": "Created",
            "IdleResourceSharing": "Created",
        },
        "ClusterArn": arn,
        "SchedulerConfig": POLICY,
        "Description": "first",
        "CreationTime": described["CreationTime"],
        "LastModifiedTime": described["CreationTime"],
    }

    control_plane.clock.advance(5)
    updated = sm.update_cluster_scheduler_config(
        ClusterSchedulerConfigId=config_id, TargetVersion=1, SchedulerConfig={"FairShare": "Disabled"}
    )
    assert updated["ClusterSchedulerConfigVersion"] == 2
    latest = sm.describe_cluster_scheduler_config(ClusterSchedulerConfigId=config_id)
    assert (latest["ClusterSchedulerConfigVersion"], latest["Status"]) == (2, "Updated")
    assert latest["SchedulerConfig"] == {"FairShare": "Disabled"}
    assert latest["Description"] == "first"  # kept when the update does not give one
    assert latest["LastModifiedTime"] > latest["CreationTime"]
    first = sm.describe_cluster_scheduler_config(
        ClusterSchedulerConfigId=config_id, ClusterSchedulerConfigVersion=1
    )
    assert first["SchedulerConfig"] == POLICY

    assert error_of(
        sm.update_cluster_scheduler_config, ClusterSchedulerConfigId=config_id, TargetVersion=1
    ) == (
        "ConflictException",
        f"TargetVersion 1 is not the current version of cluster scheduler config '{config_id}' (2); "
        "describe it and update that version.",
    )
    assert error_of(
        sm.describe_cluster_scheduler_config,
        ClusterSchedulerConfigId=config_id,
        ClusterSchedulerConfigVersion=3,
    ) == (
        "ResourceNotFound",
        f"Cluster scheduler config '{config_id}' has no version 3; its versions are 1 to 2.",
    )

    sm.delete_cluster_scheduler_config(ClusterSchedulerConfigId=config_id)
    assert error_of(sm.describe_cluster_scheduler_config, ClusterSchedulerConfigId=config_id) == (
        "ResourceNotFound",
        f"Cluster scheduler config '{config_id}' does not exist.",
    )
    assert (
        error_of(sm.delete_cluster_scheduler_config, ClusterSchedulerConfigId=config_id)[0]
        == "ResourceNotFound"
    )


def test_rules(control_plane: ControlPlane, sm: Any) -> None:
    arn = eks_cluster(sm)
    sm.create_cluster_scheduler_config(Name="one", ClusterArn=arn, SchedulerConfig=POLICY)
    code, message = error_of(
        sm.create_cluster_scheduler_config, Name="two", ClusterArn=arn, SchedulerConfig=POLICY
    )
    assert code == "ConflictException"
    assert message.startswith("Cluster 'c' already has a cluster scheduler config (")
    plain = sm.create_cluster(ClusterName="plain", InstanceGroups=[group()])["ClusterArn"]
    assert error_of(sm.create_cluster_scheduler_config, Name="p", ClusterArn=plain, SchedulerConfig={}) == (
        "ValidationException",
        "Cluster 'plain' is not orchestrated by EKS; task governance (cluster scheduler configs) is "
        "available only on EKS-orchestrated clusters.",
    )
    missing = arn[:-12] + "zzzzzzzzzzzz"
    assert error_of(sm.create_cluster_scheduler_config, Name="p", ClusterArn=missing, SchedulerConfig={}) == (
        "ValidationException",
        f"Cluster '{missing}' does not exist.",
    )
    code, message = error_of(
        sm.create_cluster_scheduler_config,
        Name="p",
        ClusterArn=arn,
        SchedulerConfig={"PriorityClasses": [{"Name": "x", "Weight": 101}]},
    )
    assert (code, message) == (
        "ValidationException",
        "1 validation error detected: Value '101' at 'schedulerConfig.priorityClasses.1.member.weight' "
        "failed to satisfy constraint: Member must have value less than or equal to 100",
    )


def test_list_filters_sorting_paging_and_cluster_deletion(control_plane: ControlPlane, sm: Any) -> None:
    a = eks_cluster(sm, "a")
    b = eks_cluster(sm, "b")
    first = sm.create_cluster_scheduler_config(Name="zeta", ClusterArn=a, SchedulerConfig=POLICY)
    control_plane.clock.advance(1)
    second = sm.create_cluster_scheduler_config(Name="alpha", ClusterArn=b, SchedulerConfig=POLICY)

    def ids(**kwargs: Any) -> list[str]:
        found = sm.list_cluster_scheduler_configs(**kwargs)["ClusterSchedulerConfigSummaries"]
        return [s["ClusterSchedulerConfigId"] for s in found]

    one, two = first["ClusterSchedulerConfigId"], second["ClusterSchedulerConfigId"]
    assert ids() == [two, one]  # newest first
    assert ids(SortOrder="Ascending") == [one, two]
    assert ids(SortBy="Name", SortOrder="Ascending") == [two, one]
    assert ids(ClusterArn=a) == [one]
    assert ids(NameContains="et") == [one]
    assert ids(Status="Updated") == []
    summary = sm.list_cluster_scheduler_configs(ClusterArn=b)["ClusterSchedulerConfigSummaries"][0]
    assert (
        summary["Name"],
        summary["ClusterArn"],
        summary["Status"],
        summary["ClusterSchedulerConfigVersion"],
    ) == (
        "alpha",
        b,
        "Created",
        1,
    )
    page = sm.list_cluster_scheduler_configs(MaxResults=1)
    assert len(page["ClusterSchedulerConfigSummaries"]) == 1
    rest = sm.list_cluster_scheduler_configs(MaxResults=1, NextToken=page["NextToken"])
    assert [s["ClusterSchedulerConfigId"] for s in rest["ClusterSchedulerConfigSummaries"]] == [one]

    # A policy goes with its cluster.
    control_plane.settle(sm, "a")
    sm.delete_cluster(ClusterName="a")

    def gone() -> bool:
        control_plane.advance(60)
        return ids() == [two]

    wait_for(gone, what="cluster a's policy to go with it")


def test_rest_routes(control_plane: ControlPlane, sm: Any) -> None:
    arn = eks_cluster(sm)
    base = f"{control_plane.url}/cluster-scheduler-configs"
    created = httpx.post(base, json={"Name": "p", "ClusterArn": arn, "SchedulerConfig": POLICY}).json()
    config_id = created["ClusterSchedulerConfigId"]
    assert (
        httpx.patch(f"{base}/{config_id}", json={"TargetVersion": 1, "Description": "d"}).json()[
            "ClusterSchedulerConfigVersion"
        ]
        == 2
    )
    old = httpx.get(f"{base}/{config_id}", params={"ClusterSchedulerConfigVersion": 1}).json()
    assert old["ClusterSchedulerConfigVersion"] == 1
    assert "Description" not in old
    assert (
        httpx.get(base).json()["ClusterSchedulerConfigSummaries"][0]["ClusterSchedulerConfigId"] == config_id
    )
    assert httpx.delete(f"{base}/{config_id}").status_code == 200
    assert httpx.get(f"{base}/{config_id}").status_code == 404
