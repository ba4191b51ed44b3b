"""Cluster extensions through boto3 over real HTTP, on SQLite and PostgreSQL: stored, validated,
versioned from hyperpod-sim's catalog, their status following the nodes."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.clusters import error_of
from tests.conftest import EKS, ControlPlane, group

SLURM = {"Slurm": {"SlurmConfigStrategy": "Managed"}}
NAME = "sagemaker-observability"


def slurm_cluster(sm: Any, name: str = "c", **extra: Any) -> str:
    kwargs: dict[str, Any] = {"NodeProvisioningMode": "Continuous", **extra}
    arn: str = sm.create_cluster(ClusterName=name, InstanceGroups=[group()], Orchestrator=SLURM, **kwargs)[
        "ClusterArn"
    ]
    return arn


def test_lifecycle(control_plane: ControlPlane, sm: Any) -> None:
    cluster = slurm_cluster(sm)
    config = {"metricsProvider": {"nodeMetrics": {"level": "ADVANCED"}}, "logs": "on"}
    arn = sm.create_cluster_extension(
        ClusterArn=cluster,
        ExtensionName=NAME,
        ExtensionVersion="1.0.0",
        ConfigurationValues=json.dumps(config),
    )["ExtensionArn"]
    cluster_id = cluster.rsplit("/", 1)[1]
    assert arn.startswith(f"arn:aws:sagemaker:us-east-1:123456789012:extension/{NAME}/{cluster_id}/")
    described = sm.describe_cluster_extension(ClusterArn=cluster, ExtensionArn=arn)
    # The nodes are still Pending, or not even added yet (Continuous provisioning adds them after
    # CreateCluster answers): either way the extension is not Active before they run.
    assert described["ExtensionDetails"]["Status"] == "Creating"
    assert described["NodeSummary"]["ActiveCount"] == 0
    assert described["NodeSummary"]["TotalCount"] in (0, 2)
    assert described["Health"] == {"Issues": []}
    assert json.loads(described["ExtensionDetails"]["ConfigurationValues"]) == config

    control_plane.settle(sm, "c")
    active = sm.describe_cluster_extension(ClusterArn=cluster, ExtensionArn=arn)
    assert active["ExtensionDetails"]["Status"] == "Active"
    assert active["NodeSummary"] == {"TotalCount": 2, "ActiveCount": 2}

    sm.update_cluster_extension(
        ClusterArn=cluster,
        ExtensionArn=arn,
        ExtensionVersion="1.1.0",
        ConfigurationValues='{"logs": null, "x": 1}',
    )
    details = sm.describe_cluster_extension(ClusterArn=cluster, ExtensionArn=arn)["ExtensionDetails"]
    assert details["ExtensionVersion"] == "1.1.0"
    assert json.loads(details["ConfigurationValues"]) == {
        "metricsProvider": {"nodeMetrics": {"level": "ADVANCED"}},
        "x": 1,
    }
    assert error_of(
        sm.update_cluster_extension, ClusterArn=cluster, ExtensionArn=arn, ExtensionVersion="1.0.0"
    ) == (
        "ValidationException",
        f"Extension '{NAME}' runs version 1.1.0; it cannot be updated to the earlier 1.0.0 (delete it and "
        "create it again with that version).",
    )
    [summary] = sm.list_cluster_extensions(ClusterArn=cluster)["Extensions"]
    assert (summary["ExtensionArn"], summary["ExtensionVersion"], summary["Status"]) == (
        arn,
        "1.1.0",
        "Active",
    )

    assert sm.delete_cluster_extension(ClusterArn=cluster, ExtensionArn=arn)["ExtensionArn"] == arn
    assert sm.list_cluster_extensions(ClusterArn=cluster)["Extensions"] == []
    assert error_of(sm.describe_cluster_extension, ClusterArn=cluster, ExtensionArn=arn) == (
        "ResourceNotFound",
        f"Extension '{arn}' does not exist on cluster 'c'.",
    )


def test_rules(control_plane: ControlPlane, sm: Any) -> None:
    cluster = slurm_cluster(sm)
    first = sm.create_cluster_extension(ClusterArn=cluster, ExtensionName=NAME, ClientToken="t1")[
        "ExtensionArn"
    ]
    # The same token and parameters: the first request's extension.
    assert (
        sm.create_cluster_extension(ClusterArn=cluster, ExtensionName=NAME, ClientToken="t1")["ExtensionArn"]
        == first
    )
    assert error_of(
        sm.create_cluster_extension,
        ClusterArn=cluster,
        ExtensionName=NAME,
        ExtensionVersion="1.0.0",
        ClientToken="t1",
    ) == ("ConflictException", "ClientToken 't1' was used with different parameters.")
    assert error_of(sm.create_cluster_extension, ClusterArn=cluster, ExtensionName=NAME) == (
        "ResourceInUse",
        f"Extension '{NAME}' is already installed on cluster 'c'.",
    )
    assert (
        sm.describe_cluster_extension(ClusterArn=cluster, ExtensionArn=first)["ExtensionDetails"][
            "ExtensionVersion"
        ]
        == "1.1.0"
    )  # the latest by default
    assert error_of(sm.create_cluster_extension, ClusterArn=cluster, ExtensionName="eks-nothing") == (
        "ValidationException",
        f"Extension 'eks-nothing' is not offered; available extensions: {NAME}.",
    )
    assert error_of(
        sm.create_cluster_extension, ClusterArn=cluster, ExtensionName=NAME, ExtensionVersion="9.0.0"
    ) == (
        "ValidationException",
        f"Version 9.0.0 of extension '{NAME}' is not offered; available versions: 1.1.0, 1.0.0.",
    )
    assert error_of(
        sm.create_cluster_extension, ClusterArn=cluster, ExtensionName=NAME, ConfigurationValues="[1]"
    ) == ("ValidationException", "ConfigurationValues must be a JSON object serialized as a string.")
    eks = sm.create_cluster(ClusterName="eks", InstanceGroups=[group()], Orchestrator=EKS)["ClusterArn"]
    assert error_of(sm.create_cluster_extension, ClusterArn=eks, ExtensionName=NAME) == (
        "ValidationException",
        "Cluster 'eks' is not orchestrated by Slurm; extensions are available only on "
        "Slurm-orchestrated clusters.",
    )
    plain = sm.create_cluster(ClusterName="plain", InstanceGroups=[group()], Orchestrator=SLURM)["ClusterArn"]
    assert error_of(sm.create_cluster_extension, ClusterArn=plain, ExtensionName=NAME) == (
        "ValidationException",
        "Cluster 'plain' does not use NodeProvisioningMode Continuous, which extensions require.",
    )
    missing = cluster[:-12] + "zzzzzzzzzzzz"
    assert error_of(sm.list_cluster_extensions, ClusterArn=missing) == (
        "ResourceNotFound",
        f"Cluster '{missing}' does not exist.",
    )


def test_versions_and_paging(control_plane: ControlPlane, sm: Any) -> None:
    versions = sm.list_cluster_extension_versions(ExtensionName=NAME)["ExtensionVersions"]
    assert versions == [{"ExtensionVersion": "1.1.0"}, {"ExtensionVersion": "1.0.0"}]
    assert sm.list_cluster_extension_versions(ExtensionName="pcs-unknown")["ExtensionVersions"] == []
    page = sm.list_cluster_extension_versions(ExtensionName=NAME, MaxResults=1)
    assert page["ExtensionVersions"] == versions[:1]
    rest = sm.list_cluster_extension_versions(ExtensionName=NAME, MaxResults=1, NextToken=page["NextToken"])
    assert rest["ExtensionVersions"] == versions[1:]


def test_rest_routes(control_plane: ControlPlane, sm: Any) -> None:
    cluster = slurm_cluster(sm)
    base = f"{control_plane.url}/cluster-extensions"
    arn = httpx.post(base, json={"ClusterArn": cluster, "ExtensionName": NAME}).json()["ExtensionArn"]
    listed = httpx.get(base, params={"ClusterArn": cluster}).json()["Extensions"]
    assert [e["ExtensionArn"] for e in listed] == [arn]
    described = httpx.get(f"{base}/describe", params={"ClusterArn": cluster, "ExtensionArn": arn}).json()
    assert described["ExtensionDetails"]["ExtensionName"] == NAME
    updated = httpx.patch(
        base, json={"ClusterArn": cluster, "ExtensionArn": arn, "ConfigurationValues": "{}"}
    )
    assert updated.json() == {"ExtensionArn": arn}
    versions = httpx.get(f"{control_plane.url}/cluster-extension-versions/{NAME}").json()
    assert versions["ExtensionVersions"][0] == {"ExtensionVersion": "1.1.0"}
    assert httpx.post(f"{base}/delete", json={"ClusterArn": cluster, "ExtensionArn": arn}).json() == {
        "ExtensionArn": arn
    }
