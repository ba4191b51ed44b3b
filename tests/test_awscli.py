"""The AWS CLI pointed at the control plane with --endpoint-url (SQLite only: the CLI adds nothing
the database could change, and each call starts a Python process)."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EKS, ControlPlane, group
from tests.helpers import aws_cli

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def aws(control_plane: ControlPlane, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return aws_cli(control_plane.url, tmp_path, *args)


def aws_json(control_plane: ControlPlane, tmp_path: Path, *args: str) -> dict[str, Any]:
    result = aws(control_plane, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    output: dict[str, Any] = json.loads(result.stdout)
    return output


def test_create_describe_list(control_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    request = {
        "ClusterName": "cli-demo",
        "InstanceGroups": [group("workers", 2)],
        "Orchestrator": EKS,
        "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 25},
        "Tags": [{"Key": "team", "Value": "research"}],
    }
    request_file = tmp_path / "create.json"
    request_file.write_text(json.dumps(request))

    created = aws_json(
        control_plane, tmp_path, "create-cluster", "--cli-input-json", f"file://{request_file}"
    )
    arn = created["ClusterArn"]
    assert arn.startswith("arn:aws:sagemaker:us-east-1:123456789012:cluster/")
    assert sm.describe_cluster(ClusterName="cli-demo")["ClusterArn"] == arn

    described = aws_json(control_plane, tmp_path, "describe-cluster", "--cluster-name", "cli-demo")
    assert described["ClusterArn"] == arn
    assert described["ClusterName"] == "cli-demo"
    assert described["ClusterStatus"] == "Creating"
    assert described["Orchestrator"] == EKS
    assert described["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 25}
    assert [
        (g["InstanceGroupName"], g["InstanceType"], g["TargetCount"]) for g in described["InstanceGroups"]
    ] == [("workers", "ml.p5.48xlarge", 2)]
    # AWS CLI v1 prints timestamps as they came over the wire: epoch seconds (the test clock's start).
    assert described["CreationTime"] == datetime(2026, 1, 1, tzinfo=UTC).timestamp()

    control_plane.settle(sm, "cli-demo")
    described = aws_json(control_plane, tmp_path, "describe-cluster", "--cluster-name", arn)
    assert described["ClusterStatus"] == "InService"
    assert described["InstanceGroups"][0]["CurrentCount"] == 2

    listed = aws_json(control_plane, tmp_path, "list-clusters")
    assert [(s["ClusterName"], s["ClusterArn"], s["ClusterStatus"]) for s in listed["ClusterSummaries"]] == [
        ("cli-demo", arn, "InService")
    ]
    tags = aws_json(control_plane, tmp_path, "list-tags", "--resource-arn", arn)
    assert tags["Tags"] == [{"Key": "team", "Value": "research"}]


def test_list_clusters_paginates_across_pages(control_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    names = {"a-1", "a-2", "a-3"}
    for name in names:
        sm.create_cluster(ClusterName=name, InstanceGroups=[group()])
    # The CLI follows NextToken itself; --page-size makes it take three pages.
    listed = aws_json(control_plane, tmp_path, "list-clusters", "--page-size", "1")
    assert {s["ClusterName"] for s in listed["ClusterSummaries"]} == names
    assert len(listed["ClusterSummaries"]) == 3


def test_describe_missing_cluster_fails(control_plane: ControlPlane, tmp_path: Path) -> None:
    result = aws(control_plane, tmp_path, "describe-cluster", "--cluster-name", "nope")
    assert result.returncode != 0
    assert result.stdout == ""
    assert "(ResourceNotFound)" in result.stderr
    assert "Cluster 'nope' does not exist." in result.stderr


def test_invalid_name_fails_with_validation_message(control_plane: ControlPlane, tmp_path: Path) -> None:
    request_file = tmp_path / "create.json"
    request_file.write_text(json.dumps({"ClusterName": "bad_name", "InstanceGroups": [group()]}))
    result = aws(control_plane, tmp_path, "create-cluster", "--cli-input-json", f"file://{request_file}")
    assert result.returncode != 0
    assert "(ValidationException)" in result.stderr
    assert "Value 'bad_name' at 'clusterName' failed to satisfy constraint" in result.stderr
