"""The checkpoint policy extension: REST resource, validation, rollout to the agents."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import EKS, ROLE, ControlPlane, group, wait_for

pytestmark = pytest.mark.patient_heartbeats

DEFAULTS = {
    "S3BaseUri": None,
    "PersistEverySteps": None,
    "PersistEverySeconds": None,
    "S3Retention": None,
    "InMemoryRetention": 3,
    "ReplicationFactor": 1,
}
GOOD = {
    "S3BaseUri": "s3://my-checkpoints/llama",
    "PersistEverySteps": 100,
    "PersistEverySeconds": 1800,
    "S3Retention": 5,
    "InMemoryRetention": 2,
    "ReplicationFactor": 2,
}


def policy_url(plane: ControlPlane, name: str) -> str:
    return f"{plane.url}/clusters/{name}/checkpoint-policy"


def test_defaults_update_and_rollout_status(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()], Orchestrator=EKS)
    got = httpx.get(policy_url(control_plane, "c")).json()
    assert {k: got[k] for k in DEFAULTS} == DEFAULTS
    assert got["PolicyGeneration"] == 1
    # Like UpdateCluster, only while InService.
    busy = httpx.put(policy_url(control_plane, "c"), json=GOOD)
    assert busy.status_code == 409
    assert busy.json()["__type"] == "ConflictException"
    control_plane.settle(sm, "c")
    put = httpx.put(policy_url(control_plane, "c"), json=GOOD)
    assert put.status_code == 200, put.text
    assert {k: put.json()[k] for k in GOOD} == GOOD
    assert put.json()["PolicyGeneration"] == 2
    control_plane.settle(sm, "c")  # simulated nodes have no agents to wait for
    assert {k: httpx.get(policy_url(control_plane, "c")).json()[k] for k in GOOD} == GOOD
    assert httpx.get(policy_url(control_plane, "nope")).status_code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"S3BaseUri": "http://bucket/x", "PersistEverySteps": 1},
            "1 validation error detected: Value 'http://bucket/x' at 's3BaseUri' failed to satisfy "
            "constraint: Member must satisfy regular expression pattern: "
            "s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\\S*)?",
        ),
        (
            {"S3BaseUri": "s3://bucket"},
            "1 validation error detected: With S3BaseUri set, PersistEverySteps or PersistEverySeconds "
            "(or both) is required",
        ),
        ({"S3Layout": "Ray"}, "1 validation error detected: S3Layout needs S3BaseUri"),
        (
            {"S3BaseUri": "s3://bucket", "PersistEverySteps": 1, "S3Layout": "Flat"},
            "1 validation error detected: Value 'Flat' at 's3Layout' failed to satisfy constraint: "
            "Member must satisfy enum value set: [Default, Ray]",
        ),
        (
            {"PersistEverySteps": 10},
            "1 validation error detected: PersistEverySteps, PersistEverySeconds and S3Retention need "
            "S3BaseUri",
        ),
        (
            {"InMemoryRetention": 0, "ReplicationFactor": 4},
            "2 validation errors detected: Value '0' at 'inMemoryRetention' failed to satisfy constraint: "
            "Member must have value greater than or equal to 1; Value '4' at 'replicationFactor' failed "
            "to satisfy constraint: Member must have value less than or equal to 3",
        ),
        (
            {"Colour": "blue"},
            "1 validation error detected: Unknown member 'Colour' at 'input': allowed members are S3BaseUri, "
            "PersistEverySteps, PersistEverySeconds, S3Retention, InMemoryRetention, ReplicationFactor, "
            "AgentAccess, S3Layout",
        ),
    ],
)
def test_validation(control_plane: ControlPlane, sm: Any, body: dict[str, Any], message: str) -> None:
    sm.create_cluster(ClusterName="v", InstanceGroups=[group()])
    control_plane.settle(sm, "v")
    response = httpx.put(policy_url(control_plane, "v"), json=body)
    assert response.status_code == 400
    assert response.json() == {"__type": "ValidationException", "message": message}
    assert {k: httpx.get(policy_url(control_plane, "v")).json()[k] for k in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_agents_apply_the_policy(agent_plane: ControlPlane, tmp_path: Any) -> None:
    sm = agent_plane.client()
    sm.create_cluster(
        ClusterName="p",
        InstanceGroups=[
            {
                "InstanceGroupName": "w",
                "InstanceType": "ml.g5.2xlarge",
                "InstanceCount": 3,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable"},
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName="p")["ClusterStatus"] == "InService",
        timeout=90,
        what="InService",
    )
    assert httpx.put(policy_url(agent_plane, "p"), json=GOOD).status_code == 200
    wait_for(
        lambda: sm.describe_cluster(ClusterName="p")["ClusterStatus"] == "InService",
        timeout=60,
        what="rollout",
    )
    nodes = httpx.get(f"{agent_plane.url}/clusters/p/nodes").json()["ClusterNodeSummaries"]
    ids = {n["InstanceId"] for n in nodes}
    for node in nodes:
        policy = httpx.get(f"{node['AgentStatus']['Endpoint']}/v1/policy").json()
        assert policy["generation"] == 2
        assert policy["in_memory_retention"] == 2
        # The endpoint is the deployment's (HPSIM_S3__*): here no S3 endpoint, so AWS's own.
        assert policy["s3"] == {
            "base_uri": "s3://my-checkpoints/llama",
            "persist_every_steps": 100,
            "persist_every_seconds": 1800,
            "retention": 5,
            "endpoint_url": None,
            "region": "us-east-1",
        }
        peers = [p["node_id"] for p in policy["replication"]["peers"]]
        assert policy["replication"]["factor"] == 2
        assert len(peers) == 2
        assert set(peers) == ids - {node["InstanceId"]}
    # A trainer may ask for more in-memory retention than the cluster's; it gets the cluster's.
    agent = nodes[0]["AgentStatus"]["Endpoint"]
    created = httpx.post(f"{agent}/v1/cp/namespaces/job", params={"num_ranks": 2, "steps_retained": 5})
    assert created.status_code == 201
    assert created.json()["steps_to_retain_per_rank"] == 2
