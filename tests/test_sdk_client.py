"""The SDK's control-plane client (hyperpod_sim/sdk/client.py) against a real control plane over HTTP: the AWS
operations through boto3, the REST extensions, the waiters, and every error as ClusterError with
the AWS code."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError
from sqlalchemy import select

from hyperpod_sim.models import Cluster
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient, WaitTimeout
from tests.conftest import EKS, ControlPlane, free_port, group
from tests.tier import cluster as tiered_cluster

pytestmark = pytest.mark.patient_heartbeats

TIERED = {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20}


@pytest.fixture
def client(control_plane: ControlPlane) -> Iterator[HyperPodClient]:
    with HyperPodClient(control_plane.url) as hyperpod:
        yield hyperpod


def create(client: HyperPodClient, name: str, count: int = 2) -> str:
    return client.create_cluster(
        ClusterName=name,
        InstanceGroups=[group("workers", count)],
        Orchestrator=EKS,
        TieredStorageConfig=TIERED,
    )


def in_service(plane: ControlPlane, client: HyperPodClient, name: str) -> dict[str, Any]:
    """Wait through the client, moving the simulated clock on at every poll."""
    return client.wait_until_in_service(name, timeout=30, on_poll=lambda _: plane.advance(60))


def fail(plane: ControlPlane, name: str, message: str) -> None:
    """Put the cluster in Failed with ``message``, as a failed creation leaves it. Nothing in the
    simulator takes that transition yet (the table allows Creating -> Failed; no reconcile step
    makes it), so the test writes it into the control plane's database."""
    with plane.services.db.write() as session:
        row = session.scalars(select(Cluster).where(Cluster.name == name)).one()
        row.status = "Failed"
        row.failure_message = message


def test_create_describe_list_update_delete(control_plane: ControlPlane, client: HyperPodClient) -> None:
    arn = create(client, "life", 2)
    assert arn.startswith("arn:aws:sagemaker:us-east-1:123456789012:cluster/")
    described = client.describe_cluster("life")
    assert (described["ClusterArn"], described["ClusterStatus"]) == (arn, "Creating")
    assert "ResponseMetadata" not in described

    seen: list[str] = []
    described = client.wait_until_in_service(
        "life", timeout=30, on_poll=lambda c: (seen.append(c["ClusterStatus"]), control_plane.advance(60))
    )
    assert described["ClusterStatus"] == "InService"
    assert (seen[0], seen[-1]) == ("Creating", "InService")
    assert [(g["InstanceGroupName"], g["CurrentCount"]) for g in described["InstanceGroups"]] == [
        ("workers", 2)
    ]
    assert [(c["ClusterName"], c["ClusterArn"], c["ClusterStatus"]) for c in client.list_clusters()] == [
        ("life", arn, "InService")
    ]

    assert client.update_cluster(ClusterName="life", InstanceGroups=[group("workers", 3)]) == arn
    assert client.describe_cluster("life")["ClusterStatus"] == "Updating"
    in_service(control_plane, client, "life")
    nodes = client.list_nodes("life")
    assert len(nodes) == 3
    assert {n["InstanceStatus"]["Status"] for n in nodes} == {"Running"}
    details = client.describe_node("life", nodes[0]["InstanceId"])
    assert (details["InstanceId"], details["InstanceGroupName"]) == (nodes[0]["InstanceId"], "workers")
    # Simulated nodes have no agents.
    assert client.agent_urls("life") == []
    descriptions = [e["Description"] for e in client.events("life")]
    assert "Cluster creation started with 2 nodes in 1 instance groups." in descriptions
    assert "Cluster update started; policy generation 2." in descriptions

    assert client.delete_cluster("life") == arn
    client.wait_until_deleted("life", timeout=30)
    assert client.list_clusters() == []


def test_errors_are_cluster_errors_with_the_aws_code(
    control_plane: ControlPlane, client: HyperPodClient
) -> None:
    # Through boto3: the botocore exception is the cause.
    with pytest.raises(ClusterError) as err:
        client.describe_cluster("nope")
    assert (err.value.code, err.value.status, err.value.message) == (
        "ResourceNotFound",
        400,
        "Cluster 'nope' does not exist.",
    )
    assert str(err.value) == "ResourceNotFound: Cluster 'nope' does not exist."
    assert isinstance(err.value.__cause__, ClientError)
    # Through REST: the same code, REST's status.
    with pytest.raises(ClusterError) as err:
        client.describe_node("nope", "i-0123456789abcdef0")
    assert (err.value.code, err.value.status, err.value.message) == (
        "ResourceNotFound",
        404,
        "Cluster 'nope' does not exist.",
    )
    # Refused by the service's semantic checks.
    with pytest.raises(ClusterError) as err:
        client.create_cluster(ClusterName="dup", InstanceGroups=[group("a", 1), group("a", 1)])
    assert err.value.code == "ValidationException"
    assert "appears more than once" in err.value.message
    # Refused by botocore before anything is sent.
    with pytest.raises(ClusterError) as err:
        client.create_cluster(ClusterName="x", InstanceGroups=[group("a", "two")])
    assert err.value.code == "ParamValidationError"
    assert "Invalid type for parameter InstanceGroups[0].InstanceCount" in err.value.message


def test_no_control_plane_is_an_endpoint_connection_error() -> None:
    with HyperPodClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
        with pytest.raises(ClusterError) as err:
            client.list_nodes("any")
        assert err.value.code == "EndpointConnectionError"
        with pytest.raises(ClusterError) as err:
            client.describe_cluster("any")
        assert err.value.code == "EndpointConnectionError"


def test_checkpoint_policy(control_plane: ControlPlane, client: HyperPodClient) -> None:
    arn = create(client, "pol")
    in_service(control_plane, client, "pol")
    assert client.get_checkpoint_policy("pol") == {
        "ClusterName": "pol",
        "ClusterArn": arn,
        "S3BaseUri": None,
        "PersistEverySteps": None,
        "PersistEverySeconds": None,
        "S3Retention": None,
        "InMemoryRetention": 3,
        "ReplicationFactor": 1,
        "AgentAccess": "Open",
        "PolicyGeneration": 1,
    }
    token = client.checkpoint_token("pol")
    assert len(token) == 64
    assert token == client.checkpoint_token("pol")  # one per cluster, made with it
    answer = client.put_checkpoint_policy(
        "pol", S3BaseUri="s3://ckpt/pol", PersistEverySteps=10, S3Retention=2
    )
    assert answer["PolicyGeneration"] == 2
    policy = client.get_checkpoint_policy("pol")
    assert (policy["S3BaseUri"], policy["PersistEverySteps"], policy["S3Retention"]) == (
        "s3://ckpt/pol",
        10,
        2,
    )

    with pytest.raises(ClusterError) as err:
        client.put_checkpoint_policy("pol", S3BaseUri="s3://ckpt/pol", PersistEverySteps=0)
    assert (err.value.code, err.value.status) == ("ValidationException", 400)
    assert err.value.message == (
        "1 validation error detected: Value '0' at 'persistEverySteps' failed to satisfy constraint: "
        "Member must have value greater than or equal to 1"
    )
    assert client.get_checkpoint_policy("pol")["PolicyGeneration"] == 2  # nothing changed

    # While the cluster is Updating (a scale-up whose nodes are not up yet) the policy is refused.
    client.update_cluster(ClusterName="pol", InstanceGroups=[group("workers", 3)])
    with pytest.raises(ClusterError) as err:
        client.put_checkpoint_policy("pol", S3BaseUri="s3://ckpt/other", PersistEverySteps=5)
    assert (err.value.code, err.value.status) == ("ConflictException", 409)
    assert err.value.message == (
        "Cluster 'pol' is Updating; its checkpoint policy can change only while the cluster is InService."
    )


def test_wait_until_in_service_fails_with_the_failure_message(
    control_plane: ControlPlane, client: HyperPodClient
) -> None:
    create(client, "broken")
    fail(control_plane, "broken", "Lifecycle script on_create.sh failed on 1 of 2 nodes (exit 1).")
    with pytest.raises(ClusterError) as err:
        client.wait_until_in_service("broken", timeout=30)
    assert not isinstance(err.value, WaitTimeout)
    assert err.value.code == "Failed"
    assert err.value.message == (
        "cluster broken is Failed: Lifecycle script on_create.sh failed on 1 of 2 nodes (exit 1)."
    )
    # Waiting for the deletion of a cluster that nobody deletes fails the same way.
    with pytest.raises(ClusterError) as err:
        client.wait_until_deleted("broken", timeout=30)
    assert err.value.code == "Failed"
    # A failed cluster can be deleted.
    client.delete_cluster("broken")
    client.wait_until_deleted("broken", timeout=30)
    with pytest.raises(ClusterError) as err:
        client.describe_cluster("broken")
    assert err.value.code == "ResourceNotFound"


def test_wait_timeout(control_plane: ControlPlane, client: HyperPodClient) -> None:
    create(client, "slow")  # the simulated clock does not move: it stays Creating
    polls: list[str] = []
    with pytest.raises(WaitTimeout) as err:
        client.wait_until_in_service("slow", timeout=0.5, on_poll=lambda c: polls.append(c["ClusterStatus"]))
    assert isinstance(err.value, ClusterError)
    assert err.value.code == "WaitTimeout"
    assert err.value.message == "cluster slow is still Creating after 0.5 s (waiting for it to be InService)"
    assert polls
    assert set(polls) == {"Creating"}
    with pytest.raises(WaitTimeout) as err:
        client.wait_until_deleted("slow", timeout=0.2)
    assert err.value.message == "cluster slow is still Creating after 0.2 s (waiting for it to be deleted)"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_nodes_carry_their_agent_status(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    members = tiered_cluster(sm, agent_plane, "agents", 2, instance_type="ml.g5.2xlarge")
    with HyperPodClient(agent_plane.url) as client:
        nodes = client.list_nodes("agents")
        assert sorted(n["InstanceId"] for n in nodes) == sorted(m["InstanceId"] for m in members)
        for node in nodes:
            agent = node["AgentStatus"]
            assert re.fullmatch(r"http://127\.77\.\d+\.\d+:9200", agent["Endpoint"]), (
                agent
            )  # its node's address
            assert agent["AppliedPolicyGeneration"] == 1
            details = client.describe_node("agents", node["InstanceId"])
            assert details["AgentStatus"]["DesiredPolicyGeneration"] == 1
            assert details["AgentStatus"]["Endpoint"] == agent["Endpoint"]
        assert sorted(client.agent_urls("agents")) == sorted(n["AgentStatus"]["Endpoint"] for n in nodes)
        # A policy change rolls out to the agents: each applies the new generation.
        client.put_checkpoint_policy("agents", InMemoryRetention=2)
        client.wait_until_in_service("agents", timeout=60)
        assert {n["AgentStatus"]["AppliedPolicyGeneration"] for n in client.list_nodes("agents")} == {2}
