"""The control plane's side of the S3 checkpoint tier: the embedded S3 endpoint of ``serve``, the
endpoint in each node's policy, the S3 status agents report in heartbeats (AgentStatus.S3Tier),
the events agents record, and the window in which a draining agent is still heard.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from pydantic import SecretStr

from hyperpod_sim.agents.control_plane import ControlPlaneClient
from hyperpod_sim.agents.loop import AgentLoop, Backoff, Identity
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.serve.embedded_s3 import DUMMY_CREDENTIALS, agent_credentials, start_moto_s3
from hyperpod_sim.settings import S3Settings
from tests.conftest import (
    EKS,
    ControlPlane,
    embedded_s3_port,
    free_port,
    group,
    kill_processes_under,
    node_token,
    shm_root_for,
    wait_for,
    wait_gone,
)

S3_STATUS = {
    "pending_steps": 2,
    "lag_seconds": 12.5,
    "persisted_steps_total": 7,
    "failures_total": 1,
    "last_persisted": {"job": 300, "eval": 40},
    "last_error": "SlowDown: Please reduce your request rate.",
}
S3_TIER = {
    "PendingSteps": 2,
    "LagSeconds": 12.5,
    "PersistedStepsTotal": 7,
    "FailuresTotal": 1,
    "LastPersistedSteps": {"job": 300, "eval": 40},
    "LastError": "SlowDown: Please reduce your request rate.",
}
LINGERING_AGENT = [sys.executable, str(Path(__file__).resolve().parent / "lingering_agent.py"), "agent"]


def s3_client(
    endpoint_url: str, region: str = "us-east-1", access_key: str = "testing", secret_key: str = "testing"
) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def token_of(plane: ControlPlane, name: str) -> str:
    token: str = plane.services.clusters.agent_bootstrap(name=name).token
    return token


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def node_ids(sm: Any, name: str) -> list[str]:
    return [n["InstanceId"] for n in sm.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"]]


def node_details(plane: ControlPlane, name: str, node_id: str) -> dict[str, Any]:
    """Over REST, which carries the AgentStatus extension (boto3 drops it)."""
    response = httpx.get(f"{plane.url}/clusters/{name}/nodes/{node_id}", timeout=10)
    assert response.status_code == 200, response.text
    details: dict[str, Any] = response.json()["NodeDetails"]
    return details


def event_descriptions(sm: Any, name: str) -> list[str]:
    pages = sm.get_paginator("list_cluster_events").paginate(ClusterName=name, SortOrder="Ascending")
    return [event["Description"] for page in pages for event in page["Events"]]


def in_service(plane: ControlPlane, sm: Any, name: str, count: int = 2, **extra: Any) -> list[str]:
    """A simulated cluster, InService: its nodes exist, no agent runs for them."""
    sm.create_cluster(ClusterName=name, InstanceGroups=[group("workers", count)], Orchestrator=EKS, **extra)
    plane.settle(sm, name)
    return node_ids(sm, name)


# ------------------------------------------------------------------------------ embedded S3


def test_embedded_moto_serves_its_bucket_until_stopped() -> None:
    with start_moto_s3(S3Settings(bucket="hpsim-embedded-test")) as s3:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", s3.endpoint_url), s3.endpoint_url
        client = s3_client(s3.endpoint_url)
        client.put_object(Bucket="hpsim-embedded-test", Key="step/1", Body=b"shard")
        assert client.get_object(Bucket="hpsim-embedded-test", Key="step/1")["Body"].read() == b"shard"
    with pytest.raises(httpx.ConnectError):
        httpx.get(s3.endpoint_url, timeout=5)


def test_embedded_moto_creates_the_bucket_in_its_region() -> None:
    with start_moto_s3(S3Settings(bucket="hpsim-embedded-eu", region="eu-west-1")) as s3:
        location = s3_client(s3.endpoint_url, "eu-west-1").get_bucket_location(Bucket="hpsim-embedded-eu")
        assert location["LocationConstraint"] == "eu-west-1"


def test_agents_of_moto_get_dummy_credentials_only_without_credentials_of_their_own() -> None:
    assert (
        agent_credentials({})
        == DUMMY_CREDENTIALS
        == {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
        }
    )
    assert agent_credentials({"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s"}) == {}
    assert agent_credentials({"AWS_ACCESS_KEY_ID": "AKIA"}) == {}  # never completed behind one's back


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("kind", ["seaweedfs", "moto"])
def test_serve_starts_an_embedded_s3_endpoint_for_its_agents(
    database_url: str, tmp_path: Path, kind: str
) -> None:
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HPSIM_S3__", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    }
    env.update(
        HPSIM_PROVISIONING__MODE="local",
        HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S="0.2",
        HPSIM_RECONCILER__INTERVAL_S="0.2",
        HPSIM_SIMULATION__SHM_ROOT=str(shm_root_for(tmp_path)),
        HPSIM_S3__EMBEDDED_PORT=str(embedded_s3_port(tmp_path / "data")),
    )
    if kind == "moto":
        env["HPSIM_S3__EMBEDDED"] = "moto"  # the default is seaweedfs
    argv = [sys.executable, "-m", "hyperpod_sim", "serve", "--port", str(port)]
    argv += ["--database-url", database_url, "--data-dir", str(tmp_path / "data")]
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log)
    try:
        assert serve.stdout is not None
        first = serve.stdout.readline().decode().strip()
        if kind == "moto":
            found = re.fullmatch(
                r"embedded S3 \(moto, not durable\) at (http://127\.0\.0\.1:\d+), bucket hpsim-checkpoints",
                first,
            )
            credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        else:
            credentials_file = tmp_path / "data" / "s3-credentials"
            found = re.fullmatch(
                r"embedded S3 \(SeaweedFS, durable\) at (http://127\.0\.0\.1:\d+), bucket "
                rf"hpsim-checkpoints, credentials in {re.escape(str(credentials_file))}",
                first,
            )
            credentials = credentials_in(credentials_file)
        assert found, (first, (tmp_path / "serve.log").read_text())
        endpoint = found.group(1)
        client = s3_client(endpoint, **credentials_kwargs(credentials))
        assert "hpsim-checkpoints" in {b["Name"] for b in client.list_buckets()["Buckets"]}

        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/health"), timeout=60, what="the control plane to answer")
        sm = boto3.client(
            "sagemaker",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(retries={"max_attempts": 1}),
        )
        sm.create_cluster(
            ClusterName="emb",
            InstanceGroups=[group("workers", 1, "ml.g5.2xlarge")],
            Orchestrator=EKS,
            TieredStorageConfig={"Mode": "Enable"},
        )
        wait_for(lambda: _status(sm, "emb") == "InService", timeout=90, what="emb to be InService")
        policy = {"S3BaseUri": "s3://hpsim-checkpoints/emb", "PersistEverySteps": 10}
        assert httpx.put(f"{url}/clusters/emb/checkpoint-policy", json=policy).status_code == 200
        wait_for(lambda: _status(sm, "emb") == "InService", timeout=60, what="the policy rollout")

        node = httpx.get(f"{url}/clusters/emb/nodes").json()["ClusterNodeSummaries"][0]
        applied = httpx.get(f"{node['AgentStatus']['Endpoint']}/v1/policy").json()
        assert applied["generation"] == 2
        assert applied["s3"]["endpoint_url"] == endpoint
        assert applied["s3"]["region"] == "us-east-1"
        # The agents can sign requests to it: the local provisioner gave them its credentials.
        pids = find_agent_pids(node["InstanceId"])
        assert pids
        environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
        for name, value in credentials.items():
            assert f"{name}={value}".encode() in environ

        serve.terminate()
        # uvicorn shuts down, then re-raises the SIGTERM it caught: serve stops the embedded S3 and
        # exits with 128 + SIGTERM.
        assert serve.wait(timeout=60) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
        # The endpoint stopped with the control plane (SeaweedFS keeps what it held on disk).
        with pytest.raises(httpx.ConnectError):
            httpx.get(endpoint, timeout=5)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=30)
        kill_processes_under(tmp_path)


def credentials_in(path: Path) -> dict[str, str]:
    """The embedded SeaweedFS's credentials, from its AWS shared credentials file."""
    parser = configparser.ConfigParser()
    parser.read(path)
    return {
        "AWS_ACCESS_KEY_ID": parser["default"]["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": parser["default"]["aws_secret_access_key"],
    }


def credentials_kwargs(credentials: dict[str, str]) -> dict[str, str]:
    return {
        "access_key": credentials["AWS_ACCESS_KEY_ID"],
        "secret_key": credentials["AWS_SECRET_ACCESS_KEY"],
    }


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _status(sm: Any, name: str) -> str:
    status: str = sm.describe_cluster(ClusterName=name)["ClusterStatus"]
    return status


# ------------------------------------------------------------------------------ policy


@pytest.mark.parametrize(
    "settings_overrides",
    [{"s3": {"endpoint_url": "http://minio.example:9000", "region": "eu-west-1", "embedded": False}}],
)
def test_the_policy_hands_the_s3_endpoint_to_the_agents(control_plane: ControlPlane, sm: Any) -> None:
    (node, _) = in_service(
        control_plane,
        sm,
        "pol",
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
    )
    policy_url = f"{control_plane.url}/agent/v1/clusters/pol/nodes/{node}/policy"
    headers = auth(node_token(control_plane, node))
    assert httpx.get(policy_url, headers=headers).json()["s3"] is None  # no S3BaseUri yet
    body = {"S3BaseUri": "s3://hpsim-checkpoints/pol", "PersistEverySeconds": 60}
    assert httpx.put(f"{control_plane.url}/clusters/pol/checkpoint-policy", json=body).status_code == 200
    assert httpx.get(policy_url, headers=headers).json()["s3"] == {
        "base_uri": "s3://hpsim-checkpoints/pol",
        "persist_every_steps": None,
        "persist_every_seconds": 60,
        "retention": None,
        "endpoint_url": "http://minio.example:9000",
        "region": "eu-west-1",
    }


# ------------------------------------------------------------------------------ heartbeat s3 status


async def _heartbeat(plane: ControlPlane, cluster: str, node_id: str, provider: Any) -> AgentState:
    """One heartbeat by the agent's own loop and client, over HTTP, as the registered agent of the
    node (with a node token made as registration makes one)."""

    async def no_wait(seconds: float) -> None:
        return None

    token = SecretStr(node_token(plane, node_id))
    state = AgentState(cluster=cluster, node_id=node_id)
    state.mark_registered(
        node_id=node_id,
        cluster_token=SecretStr(token_of(plane, cluster)),
        node_token=token,
        control_plane_token=SecretStr("unused: nothing pushes to this agent"),
    )
    async with ControlPlaneClient(base_url=plane.url, cluster=cluster, timeout_s=10) as client:
        loop = AgentLoop(
            state=state,
            client=client,
            identity=Identity(
                endpoint="http://127.0.0.1:9", pid=os.getpid(), instance_type=None, memory_bytes=0
            ),
            token=token,
            heartbeat_interval_s=1.0,
            adopt_control_plane_interval=False,
            backoff=Backoff(initial_s=0.01, max_s=0.01),
            permanent_retry_s=0.01,
            sleep=no_wait,
            status_provider=provider,
        )
        await loop.heartbeat_once()
    return state


def test_heartbeat_s3_status_shows_in_agent_status(control_plane: ControlPlane, sm: Any) -> None:
    node = in_service(control_plane, sm, "hb", 1)[0]
    state = asyncio.run(_heartbeat(control_plane, "hb", node, lambda: S3_STATUS))
    assert state.counters.heartbeats_total == 1
    assert node_details(control_plane, "hb", node)["AgentStatus"]["S3Tier"] == S3_TIER
    listed = httpx.get(f"{control_plane.url}/clusters/hb/nodes").json()["ClusterNodeSummaries"]
    assert listed[0]["AgentStatus"]["S3Tier"] == S3_TIER
    # The same member over AWS JSON, for clients that read the raw answer.
    raw = httpx.post(
        f"{control_plane.url}/",
        headers={
            "X-Amz-Target": "SageMaker.DescribeClusterNode",
            "Content-Type": "application/x-amz-json-1.1",
        },
        content=json.dumps({"ClusterName": "hb", "NodeId": node}),
    )
    assert raw.json()["NodeDetails"]["AgentStatus"]["S3Tier"] == S3_TIER

    # No error any more: LastError is absent, like AgentStatus.LastError.
    healthy = {**S3_STATUS, "pending_steps": 0, "last_error": None}
    asyncio.run(_heartbeat(control_plane, "hb", node, lambda: healthy))
    tier = node_details(control_plane, "hb", node)["AgentStatus"]["S3Tier"]
    assert tier == {**{k: v for k, v in S3_TIER.items() if k != "LastError"}, "PendingSteps": 0}

    # A provider that fails costs the report, not the heartbeat; no report clears the status.
    def broken() -> dict[str, Any]:
        raise RuntimeError("the tier is gone")

    state = asyncio.run(_heartbeat(control_plane, "hb", node, broken))
    assert state.counters.heartbeats_total == 1
    assert "S3Tier" not in node_details(control_plane, "hb", node)["AgentStatus"]


def test_openapi_documents_the_agent_status(control_plane: ControlPlane) -> None:
    document = httpx.get(f"{control_plane.url}/openapi.json", timeout=60).json()
    schemas = document["components"]["schemas"]
    for shape in ("ClusterNodeDetails", "ClusterNodeSummary"):
        assert schemas[shape]["properties"]["AgentStatus"] == {"$ref": "#/components/schemas/AgentStatus"}
    agent_status = schemas["AgentStatus"]["properties"]
    assert set(agent_status["S3Tier"]["properties"]) == set(S3_TIER)
    assert "/agent/v1/clusters/{cluster}/events" in document["paths"]


@pytest.mark.parametrize(
    ("s3", "message"),
    [
        ([1, 2], "s3 must be an object or null, got list."),
        ("pending", "s3 must be an object or null, got str."),
        ({"pending_steps": "many"}, "s3.pending_steps must be a non-negative integer, got 'many'."),
        ({"failures_total": -1}, "s3.failures_total must be a non-negative integer, got -1."),
        ({"lag_seconds": True}, "s3.lag_seconds must be a non-negative number, got True."),
        ({"last_persisted": [300]}, "s3.last_persisted must be an object of namespace -> step, got [300]."),
        (
            {"last_persisted": {"job": 1.5}},
            "s3.last_persisted['job'] must be a non-negative integer, got 1.5.",
        ),
        ({"last_error": 42}, "s3.last_error must be a string or null, got 42."),
        (
            {"last_persisted": {f"namespace-{i:04d}": i for i in range(500)}},
            "s3 is 10410 bytes of JSON; at most 8192 are accepted.",
        ),
    ],
)
def test_a_bad_s3_status_is_refused(control_plane: ControlPlane, sm: Any, s3: Any, message: str) -> None:
    node = in_service(control_plane, sm, "bad", 1)[0]
    asyncio.run(_heartbeat(control_plane, "bad", node, lambda: S3_STATUS))
    response = httpx.post(
        f"{control_plane.url}/agent/v1/clusters/bad/nodes/{node}/heartbeat",
        json={"applied_generation": 1, "s3": s3},
        headers=auth(node_token(control_plane, node)),
    )
    assert response.status_code == 400
    assert response.json() == {"error": "InvalidS3Status", "message": message}
    # Refused as a whole: what the last good heartbeat reported stays.
    assert node_details(control_plane, "bad", node)["AgentStatus"]["S3Tier"] == S3_TIER


# ------------------------------------------------------------------------------ events from agents


def test_agent_events_show_in_the_cluster_events(control_plane: ControlPlane, sm: Any) -> None:
    node = in_service(control_plane, sm, "ev", 1)[0]
    url = f"{control_plane.url}/agent/v1/clusters/ev/events"
    headers = auth(node_token(control_plane, node))
    message = "Step 300 of namespace job was not persisted to S3: SlowDown."
    created = httpx.post(url, json={"node_id": node, "level": "Warn", "message": message}, headers=headers)
    assert created.status_code == 201, created.text
    event_id = created.json()["event_id"]
    assert set(created.json()) == {"event_id"}

    expected = {
        "EventId": event_id,
        "ClusterName": "ev",
        "InstanceGroupName": "workers",
        "InstanceId": node,
        "ResourceType": "Instance",
        "Description": message,
        "EventLevel": "Warn",
    }
    listed = sm.list_cluster_events(ClusterName="ev", ResourceType="Instance")["Events"]
    mine = [e for e in listed if e["EventId"] == event_id]
    assert len(mine) == 1
    assert {k: mine[0].get(k) for k in expected} == expected
    details = sm.describe_cluster_event(ClusterName="ev", EventId=event_id)["EventDetails"]
    assert {k: details.get(k) for k in expected} == expected


@pytest.mark.parametrize(
    ("body", "token", "status", "error"),
    [
        ({"level": "Info", "message": "m"}, None, 401, "MissingToken"),
        ({"level": "Info", "message": "m"}, "not-the-token", 403, "InvalidToken"),
        ({"level": "Info", "message": "m"}, "cluster", 403, "InvalidToken"),
        ({"level": "Info", "message": "m", "node_id": "i-0000000000000000a"}, "node", 403, "WrongNode"),
        ({"level": "Debug", "message": "m"}, "node", 400, "InvalidRequest"),
        ({"level": "Info", "message": ""}, "node", 400, "InvalidRequest"),
        ({"level": "Info", "message": "x" * 2049}, "node", 400, "InvalidRequest"),
    ],
)
def test_agent_events_are_checked(
    control_plane: ControlPlane, sm: Any, body: dict[str, Any], token: str | None, status: int, error: str
) -> None:
    node = in_service(control_plane, sm, "evc", 1)[0]
    before = event_descriptions(sm, "evc")
    if token == "cluster":  # the agents' shared token reports nothing: events are a node's own
        token = token_of(control_plane, "evc")
    elif token == "node":
        token = node_token(control_plane, node)
    response = httpx.post(
        f"{control_plane.url}/agent/v1/clusters/evc/events",
        json={"node_id": node, **body},
        headers=auth(token) if token else {},
    )
    assert response.status_code == status, response.text
    assert response.json()["error"] == error
    assert event_descriptions(sm, "evc") == before


# ------------------------------------------------------------------------------ draining agents


def release(tmp_path: Path, node_id: str) -> None:
    """Let the lingering agent of ``node_id`` exit (tests/lingering_agent.py)."""
    (tmp_path / "data" / "agents" / node_id / "release").touch()


def node_status(sm: Any, name: str) -> dict[str, str]:
    summaries = sm.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"]
    return {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in summaries}


def record(plane: ControlPlane, name: str, token: str, node_id: str, message: str) -> httpx.Response:
    return httpx.post(
        f"{plane.url}/agent/v1/clusters/{name}/events",
        json={"node_id": node_id, "level": "Error", "message": message},
        headers=auth(token),
    )


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "agent_settings", [{"provisioning": {"agent_command": LINGERING_AGENT}}], indirect=True
)
def test_a_draining_agent_is_heard_until_it_exits(agent_plane: ControlPlane, tmp_path: Path) -> None:
    """An agent told to stop drains to S3 first: until its process has exited, its node stays
    ShuttingDown (and a deleted cluster Deleting), and the calls a draining agent makes answer."""
    sm = agent_plane.client()
    sm.create_cluster(
        ClusterName="drain",
        InstanceGroups=[group("workers", 2, "ml.g5.2xlarge")],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable"},
    )
    wait_for(lambda: _status(sm, "drain") == "InService", timeout=90, what="drain to be InService")
    api = f"{agent_plane.url}/agent/v1/clusters/drain"
    victim, survivor = node_ids(sm, "drain")
    # The test plays the victim's agent (whose own node token then stops working: it is deleted
    # right after, so its heartbeats answer 404 whatever token they carry).
    token = node_token(agent_plane, victim)
    created = httpx.post(
        f"{api}/namespaces/job", json={"num_ranks": 2, "steps_retained": 1}, headers=auth(token)
    )
    assert created.status_code == 201, created.text

    # Scale-down: the victim's node stays ShuttingDown while its agent lingers.
    sm.batch_delete_cluster_nodes(ClusterName="drain", NodeIds=[victim])
    wait_for(
        lambda: node_details(agent_plane, "drain", survivor)["AgentStatus"]["AppliedPolicyGeneration"] == 2,
        timeout=60,
        what="the survivor to apply the new ring (a reconcile pass after the deletion)",
    )
    wait_for(lambda: len(find_agent_pids(victim)) == 1, timeout=60, what="the victim's agent to be stopped")
    assert node_status(sm, "drain") == {victim: "ShuttingDown", survivor: "Running"}
    scaled = record(agent_plane, "drain", token, victim, "Step 7 of namespace job was not persisted to S3.")
    assert scaled.status_code == 201, scaled.text
    assert httpx.get(f"{api}/namespaces/job", headers=auth(token)).status_code == 200
    # A draining agent is still a member: its peers ask it for the ranks it holds.
    members = httpx.get(f"{api}/members", headers=auth(token)).json()["members"]
    assert {m["node_id"]: m["status"] for m in members} == {victim: "ShuttingDown", survivor: "Running"}
    # The heartbeat still says the node is gone: that is how an agent learns it was deleted.
    heartbeat = httpx.post(
        f"{api}/nodes/{victim}/heartbeat", json={"applied_generation": 2}, headers=auth(token)
    )
    assert heartbeat.status_code == 404
    release(tmp_path, victim)
    wait_for(lambda: victim not in node_status(sm, "drain"), timeout=30, what="the victim's node to go")
    assert "Step 7 of namespace job was not persisted to S3." in event_descriptions(sm, "drain")

    # DeleteCluster: the cluster stays Deleting until the last agent has exited.
    sm.delete_cluster(ClusterName="drain")
    wait_for(lambda: node_status(sm, "drain") == {survivor: "ShuttingDown"}, timeout=30, what="ShuttingDown")
    wait_for(
        lambda: len(find_agent_pids(survivor)) == 1, timeout=60, what="the survivor's agent to be stopped"
    )
    assert _status(sm, "drain") == "Deleting"
    token = node_token(agent_plane, survivor)  # the survivor's agent, now the test's to play
    deleting = record(
        agent_plane, "drain", token, survivor, "Step 9 of namespace job was not persisted to S3."
    )
    assert deleting.status_code == 201, deleting.text
    event = sm.describe_cluster_event(ClusterName="drain", EventId=deleting.json()["event_id"])[
        "EventDetails"
    ]
    assert event["EventLevel"] == "Error"
    assert event["InstanceId"] == survivor
    assert httpx.get(f"{api}/namespaces/job", headers=auth(token)).json()["namespace"] == "job"
    members = httpx.get(f"{api}/members", headers=auth(token)).json()["members"]
    assert {m["node_id"]: m["status"] for m in members} == {survivor: "ShuttingDown"}
    release(tmp_path, survivor)
    wait_gone(sm, "drain", timeout=30)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "agent_settings",
    [{"provisioning": {"agent_command": LINGERING_AGENT, "kill_grace_s": 1.0}}],
    indirect=True,
)
def test_an_agent_that_does_not_exit_is_killed_after_the_grace_period(
    agent_plane: ControlPlane, tmp_path: Path
) -> None:
    sm = agent_plane.client()
    sm.create_cluster(ClusterName="stuck", InstanceGroups=[group("workers", 1, "ml.g5.2xlarge")])
    wait_for(lambda: _status(sm, "stuck") == "InService", timeout=90, what="stuck to be InService")
    (node,) = node_ids(sm, "stuck")
    sm.delete_cluster(ClusterName="stuck")
    # Never released: the provisioner kills it once HPSIM_PROVISIONING__KILL_GRACE_S has passed,
    # long before the lingering agent's own deadline (120 s).
    wait_gone(sm, "stuck", timeout=30)
    assert not find_agent_pids(node)
    assert not (tmp_path / "data" / "agents" / node / "release").exists()
