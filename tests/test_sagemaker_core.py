"""sagemaker-core (the SageMaker Python SDK's resource layer, ``sagemaker.core.resources``) against
the service over real HTTP, on SQLite and PostgreSQL, pointed here the way a user points it:
``AWS_ENDPOINT_URL_SAGEMAKER`` and a boto3 session of their own. What issue 15 asks of it: the
cluster's nodes, deleting nodes, the scheduler-config resource, and what ``update_software`` does."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from botocore.exceptions import ParamValidationError

from tests.conftest import EKS, ControlPlane, group, wait_for

resources = pytest.importorskip("sagemaker.core.resources")
shapes = pytest.importorskip("sagemaker.core.shapes")


@pytest.fixture
def session(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> boto3.Session:
    """A user's own session; sagemaker-core caches clients per session, so each test gets one."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", control_plane.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    return boto3.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


def in_service(control_plane: ControlPlane, sm: Any, name: str, count: int) -> None:
    sm.create_cluster(ClusterName=name, InstanceGroups=[group(count=count)], Orchestrator=EKS)
    control_plane.settle(sm, name)


def test_cluster_nodes_and_batch_delete(control_plane: ControlPlane, sm: Any, session: boto3.Session) -> None:
    in_service(control_plane, sm, "core", 3)
    cluster = resources.Cluster.get("core", session=session, region="us-east-1")
    assert cluster.cluster_status == "InService"
    assert [g.instance_group_name for g in cluster.instance_groups] == ["workers"]
    nodes = list(cluster.get_all_nodes(session=session, region="us-east-1"))
    listed = sm.list_cluster_nodes(ClusterName="core")["ClusterNodeSummaries"]
    assert sorted(n.instance_id for n in nodes) == sorted(n["InstanceId"] for n in listed)
    assert all(n.instance_status.status == "Running" for n in nodes)
    doomed = nodes[0].instance_id
    answer = cluster.batch_delete_nodes(node_ids=[doomed, "i-00000000000000000"], session=session)
    assert answer.successful == [doomed]
    assert [f.node_id for f in answer.failed] == ["i-00000000000000000"]
    assert answer.failed[0].code == "NodeIdNotFound"

    def deleted() -> list[Any] | None:
        control_plane.advance(60)  # the node's shutdown takes simulated time
        remaining = list(cluster.get_all_nodes(session=session, region="us-east-1"))
        return remaining if doomed not in {n.instance_id for n in remaining} else None

    assert len(wait_for(deleted, what="the deleted node to leave the cluster")) == 2


def test_scheduler_config_resource(control_plane: ControlPlane, sm: Any, session: boto3.Session) -> None:
    in_service(control_plane, sm, "governed", 1)
    arn = sm.describe_cluster(ClusterName="governed")["ClusterArn"]
    created = resources.ClusterSchedulerConfig.create(
        name="policy",
        cluster_arn=arn,
        scheduler_config=shapes.SchedulerConfig(
            priority_classes=[shapes.PriorityClass(name="training", weight=50)], fair_share="Enabled"
        ),
        description="first",
        session=session,
        region="us-east-1",
    )
    assert created.cluster_scheduler_config_version == 1
    assert created.status == "Created"
    assert created.scheduler_config.fair_share == "Enabled"
    listed = list(
        resources.ClusterSchedulerConfig.get_all(cluster_arn=arn, session=session, region="us-east-1")
    )
    assert [c.cluster_scheduler_config_id for c in listed] == [created.cluster_scheduler_config_id]
    created.update(target_version=1, scheduler_config=shapes.SchedulerConfig(fair_share="Disabled"))
    again = resources.ClusterSchedulerConfig.get(
        created.cluster_scheduler_config_id, session=session, region="us-east-1"
    )
    assert again.cluster_scheduler_config_version == 2
    assert again.scheduler_config.fair_share == "Disabled"
    again.delete()
    assert sm.list_cluster_scheduler_configs(ClusterArn=arn)["ClusterSchedulerConfigSummaries"] == []


def test_update_software_fails_botocore_input_check_before_any_request(
    control_plane: ControlPlane, sm: Any, session: boto3.Session
) -> None:
    """sagemaker-core 2.27's ``Cluster.update_software`` sends the described ``InstanceGroups``
    (ClusterInstanceGroupDetails) back as UpdateClusterSoftware's ``InstanceGroups``, a list of
    ``{"InstanceGroupName": ...}``: botocore refuses the members it does not know before anything
    is sent, so nothing reaches the service. Kept as a test so a fixed release shows up here."""
    in_service(control_plane, sm, "patch", 1)
    cluster = resources.Cluster.get("patch", session=session, region="us-east-1")
    with pytest.raises(ParamValidationError, match="Unknown parameter in InstanceGroups"):
        cluster.update_software(session=session, region="us-east-1")
    operations = sm.list_cluster_operations(ClusterName="patch")["ClusterOperationSummaries"]
    assert "SoftwareUpdate" not in {op.get("OperationType") for op in operations}
    # The same call without that bug (boto3 directly, groups named) is served.
    assert sm.update_cluster_software(ClusterName="patch", InstanceGroups=[{"InstanceGroupName": "workers"}])
