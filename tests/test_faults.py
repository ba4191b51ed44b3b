"""Fault injection (REST ``/clusters/{name}/faults``, the SDK, the CLI): node faults on real agent
processes, S3 faults in the agents' own S3 clients against moto's server, the control plane's
reactions and the events that record them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import SHARED_NETWORK, ControlPlane, shm_root_for, wait_for
from tests.faults import answers, descriptions, node_loss_timeline, node_status, restart_story
from tests.helpers import hpsim, ok
from tests.s3_checkpoints import markers, save_step, set_policy
from tests.tier import cluster, create_namespace, get, members, metric, put, replicated, url

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any], request: pytest.FixtureRequest) -> dict[str, Any]:
    """S3: moto's server behind the test proxy, the agents signing with dummy credentials
    (tests/plugins/s3.py); the faults under test are injected in the agents' own S3 clients. A
    test's own settings (indirect) on top."""
    return {**s3_agent_settings, **getattr(request, "param", {})}


def applied(client: HyperPodClient, name: str, generation: int) -> bool:
    """Every node's agent applied ``generation`` (or newer)."""
    nodes = client.list_nodes(name)
    return bool(nodes) and all(
        (n.get("AgentStatus") or {}).get("AppliedPolicyGeneration", 0) >= generation for n in nodes
    )


# ---------------------------------------------------------------------- node faults


@pytest.mark.parametrize("agent_settings", [SHARED_NETWORK], indirect=True)  # back on a new endpoint
def test_agent_crash_restarts_the_agent_on_the_same_node(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "crash", 2)
    victim = nodes[0]["InstanceId"]
    before = url(nodes[0])
    assert create_namespace(before, "job", 1).status_code == 201
    data = os.urandom(200_000)
    assert put(before, "job", 0, 5, data).status_code == 200
    wait_for(lambda: replicated(before), timeout=30, what="the replica")
    (old_pid,) = find_agent_pids(victim)

    fault = client.inject_fault("crash", Type="AgentCrash", InstanceId=victim)
    assert fault["Type"] == "AgentCrash"
    assert fault["InstanceId"] == victim
    assert fault["FaultId"].startswith("f-")
    assert client.list_faults("crash") == []  # over once injected

    def restarted() -> str | None:
        pids = find_agent_pids(victim)
        if not pids or old_pid in pids:
            return None
        node = client.describe_node("crash", victim)
        endpoint = (node.get("AgentStatus") or {}).get("Endpoint")
        if node["InstanceStatus"]["Status"] != "Running" or endpoint == before or not answers(endpoint):
            return None
        return str(endpoint)

    after = wait_for(
        restarted,
        timeout=60,
        what="the agent restarted on the same node",
        explain=lambda: restart_story(
            client, "crash", Path(agent_plane.services.settings.data_dir) / "agents" / victim
        ),
    )
    assert {n["InstanceId"] for n in client.list_nodes("crash")} == {n["InstanceId"] for n in nodes}
    # The shard saved before the crash is read back from this node's own shared memory.
    wait_for(lambda: metric(after, "hpsim_tier_shards") == 1, timeout=30, what="the shard recovered")
    response = get(after, "job", 0, 5)
    assert response.status_code == 200
    assert response.content == data
    assert metric(after, "hpsim_tier_remote_reads_total") == 0
    texts = descriptions(client, "crash")
    assert any(t.startswith(f"Fault {fault['FaultId']} injected: AgentCrash on node {victim}") for t in texts)
    assert f"The agent of node {victim} exited unexpectedly; restarting it (restart 1 in a row)." in texts
    assert any(t.startswith("Agent re-registered at") for t in texts), texts
    assert not any(t.startswith(f"Node {victim} failed") for t in texts), texts


@pytest.mark.parametrize("agent_settings", [SHARED_NETWORK], indirect=True)  # back on another port
def test_replicas_reach_a_peer_whose_agent_restarted_on_another_port(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "moved", 2)
    owner, peer = url(nodes[0]), nodes[1]["InstanceId"]
    assert create_namespace(owner, "job", 1).status_code == 201
    assert put(owner, "job", 0, 1, os.urandom(50_000)).status_code == 200
    wait_for(lambda: replicated(owner), timeout=30, what="the first replica")
    client.inject_fault("moved", Type="AgentCrash", InstanceId=peer)

    def moved() -> str | None:
        endpoint = (client.describe_node("moved", peer).get("AgentStatus") or {}).get("Endpoint")
        return endpoint if endpoint not in (None, url(nodes[1])) and answers(endpoint) else None

    after = wait_for(
        moved,
        timeout=120,
        what="the peer's agent on a new port",
        explain=lambda: [(e["EventTime"], e["Description"]) for e in client.events("moved")],
    )
    data = os.urandom(60_000)
    assert put(owner, "job", 0, 2, data).status_code == 200
    # The owner finds the peer at its new endpoint (it does not retry the old one until it gives up).
    wait_for(lambda: replicated(owner), timeout=30, what="the replica of step 2")
    response = get(after, "job", 0, 2)
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["x-hpsim-tier"] == "replica"


def test_node_loss_replaces_the_node_and_its_replica_serves(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, tmp_path: Path
) -> None:
    nodes = cluster(sm, agent_plane, "lost", 2)
    victim, survivor = nodes[0]["InstanceId"], url(nodes[1])
    assert create_namespace(url(nodes[0]), "job", 1).status_code == 201
    data = os.urandom(150_000)
    assert put(url(nodes[0]), "job", 0, 2, data).status_code == 200
    wait_for(lambda: replicated(url(nodes[0])), timeout=30, what="the replica")

    fault = client.inject_fault("lost", Type="NodeLoss", InstanceId=victim)
    assert not (shm_root_for(tmp_path) / victim).exists()
    assert not find_agent_pids(victim)
    # Listed until the control plane has failed the node; it cannot be undone.
    listed = client.list_faults("lost")
    assert [f["FaultId"] for f in listed] == [fault["FaultId"]]
    with pytest.raises(ClusterError) as refused:
        client.clear_fault("lost", fault["FaultId"])
    assert refused.value.code == "ValidationException"

    def replaced() -> bool:
        current = client.list_nodes("lost")
        return (
            victim not in {n["InstanceId"] for n in current}
            and len(current) == 2
            and all(n["InstanceStatus"]["Status"] == "Running" for n in current)
        )

    wait_for(replaced, timeout=90, what="the lost node to be replaced")
    response = get(survivor, "job", 0, 2)
    assert response.status_code == 200
    assert response.content == data
    assert client.list_faults("lost") == []
    node_loss_timeline(client, "lost", fault, replacement="i-")


def test_agent_hang_fails_the_node_and_clearing_it_recovers(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "hang", 2, recovery="None")
    victim, endpoint = nodes[0]["InstanceId"], url(nodes[0])
    fault = client.inject_fault("hang", Type="AgentHang", InstanceId=victim, DurationSeconds=600)
    assert fault["EndsAt"] == pytest.approx(fault["InjectedAt"] + 600)
    assert [f["FaultId"] for f in client.list_faults("hang")] == [fault["FaultId"]]
    assert not answers(endpoint)  # the port is open; nothing answers
    with pytest.raises(ClusterError) as twice:
        client.inject_fault("hang", Type="AgentCrash", InstanceId=victim)
    assert twice.value.code == "ConflictException"
    wait_for(lambda: node_status(client, "hang", victim) == "Failure", timeout=30, what="the node to fail")

    cleared = client.clear_fault("hang", fault["FaultId"])
    assert cleared["ClearedAt"] >= cleared["InjectedAt"]
    wait_for(lambda: node_status(client, "hang", victim) == "Running", timeout=30, what="the node to recover")
    assert answers(endpoint)  # the same agent, on its port
    assert client.list_faults("hang") == []
    texts = descriptions(client, "hang")
    assert any(
        t.startswith(f"Fault {fault['FaultId']} injected: AgentHang on node {victim} (for 600 s)")
        for t in texts
    )
    assert f"Node {victim} failed: no heartbeat from its agent for 3 s." in texts
    assert any(
        t.startswith(f"Fault {fault['FaultId']} ended: AgentHang on node {victim}") and "cleared" in t
        for t in texts
    )
    assert "Agent is heartbeating again; the node is recovering." in texts


def agent_generation(endpoint: str) -> int:
    """The policy generation an agent applied, asked of the agent itself (as a trainer can)."""
    return int(httpx.get(f"{endpoint}/v1/policy", timeout=5).json()["generation"])


def test_network_partition_cuts_off_the_control_plane_only(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    nodes = cluster(sm, agent_plane, "split", 2, recovery="None")
    victim, endpoint, peer = nodes[0]["InstanceId"], url(nodes[0]), url(nodes[1])
    assert create_namespace(endpoint, "job", 1).status_code == 201
    fault = client.inject_fault("split", Type="NetworkPartition", InstanceId=victim, DurationSeconds=600)
    assert [f["FaultId"] for f in client.list_faults("split")] == [fault["FaultId"]]
    # A new policy generation reaches the peer, not the partitioned node.
    s3_fault = client.inject_fault("split", Type="S3Latency", LatencyMs=1)
    generation = s3_fault["PolicyGeneration"]
    wait_for(lambda: agent_generation(peer) >= generation, timeout=30, what="the push to the peer")
    assert agent_generation(endpoint) < generation
    # No heartbeat gets through: the control plane fails the node as if it were dead.
    wait_for(lambda: node_status(client, "split", victim) == "Failure", timeout=30, what="the node to fail")
    # Trainers and peers still reach it: a save lands, and is replicated to the peer.
    data = os.urandom(100_000)
    assert put(endpoint, "job", 0, 7, data).status_code == 200
    wait_for(lambda: replicated(endpoint), timeout=30, what="the replica")
    assert get(peer, "job", 0, 7).content == data
    assert agent_generation(endpoint) < generation

    client.clear_fault("split", fault["FaultId"])
    wait_for(
        lambda: node_status(client, "split", victim) == "Running", timeout=30, what="the node to recover"
    )
    wait_for(lambda: agent_generation(endpoint) >= generation, timeout=30, what="the missed policy")
    assert get(endpoint, "job", 0, 7).content == data
    texts = descriptions(client, "split")
    injected = f"Fault {fault['FaultId']} injected: NetworkPartition on node {victim} (for 600 s); agent pid"
    assert any(t.startswith(injected) and "trainers and peer agents still can" in t for t in texts), texts
    assert f"Node {victim} failed: no heartbeat from its agent for 3 s." in texts
    assert any(
        t.startswith(f"Fault {fault['FaultId']} ended: NetworkPartition on node {victim}") and "cleared" in t
        for t in texts
    )
    assert "Agent is heartbeating again; the node is recovering." in texts


# ---------------------------------------------------------------------- S3 faults


def test_s3_outage_holds_commits_and_persistence_catches_up(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "outage", 2)]
    set_policy(agent_plane, sm, "outage", S3BaseUri=f"s3://{bucket}/o", PersistEverySteps=1)
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    save_step(nodes, "job", 1, 2)
    wait_for(lambda: markers(s3, bucket, "o/job/") == [1], timeout=60, what="step 1 on S3")

    fault = client.inject_fault("outage", Type="S3Outage")
    assert "EndsAt" not in fault
    wait_for(
        lambda: applied(client, "outage", fault["PolicyGeneration"]), timeout=30, what="the fault applied"
    )
    assert client.describe_cluster("outage")["ClusterStatus"] == "InService"  # a fault is no update
    # Saves to memory go on while S3 is down.
    save_step(nodes, "job", 2, 2)
    save_step(nodes, "job", 3, 2)

    def failing() -> bool:
        tiers = [(n.get("AgentStatus") or {}).get("S3Tier") or {} for n in client.list_nodes("outage")]
        return any(t.get("FailuresTotal", 0) >= 1 and t.get("PendingSteps", 0) >= 1 for t in tiers)

    wait_for(failing, timeout=90, what="a persist to fail during the outage")
    assert markers(s3, bucket, "o/job/") == [1]
    assert sum(metric(n, "hpsim_s3_injected_errors_total") for n in nodes) > 0

    client.clear_fault("outage", fault["FaultId"])
    wait_for(lambda: 3 in markers(s3, bucket, "o/job/"), timeout=90, what="persistence to catch up")
    caught_up = f"S3 persistence caught up: step 3 of namespace 'job' on S3 (s3://{bucket}/o)"
    wait_for(
        lambda: any(t.startswith(caught_up) for t in descriptions(client, "outage")),
        timeout=30,
        what="the agent's catch-up event",
    )
    texts = descriptions(client, "outage")
    assert any(
        t.startswith(f"Fault {fault['FaultId']} injected: S3Outage (every S3 request fails") for t in texts
    )
    assert any(t.startswith(f"Fault {fault['FaultId']} ended: S3Outage") and "cleared" in t for t in texts)


def test_s3_errors_are_retried_until_persistence_completes(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "flaky", 2)]
    set_policy(agent_plane, sm, "flaky", S3BaseUri=f"s3://{bucket}/f", PersistEverySteps=1)
    fault = client.inject_fault("flaky", Type="S3Errors", ErrorRate=0.3, DurationSeconds=600)
    assert fault["ErrorKind"] == "Throttle"
    wait_for(
        lambda: applied(client, "flaky", fault["PolicyGeneration"]), timeout=30, what="the fault applied"
    )
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    for step in (1, 2, 3):
        save_step(nodes, "job", step, 2)
    # While a persist is retried, a newer due step replaces the queued one: step 2 may be skipped.
    wait_for(lambda: 3 in markers(s3, bucket, "f/job/"), timeout=120, what="the newest step on S3")
    assert sum(metric(n, "hpsim_s3_injected_errors_total") for n in nodes) > 0
    [listed] = client.list_faults("flaky")
    assert listed["FaultId"] == fault["FaultId"]
    client.clear_fault("flaky", fault["FaultId"])
    assert client.list_faults("flaky") == []
    texts = descriptions(client, "flaky")
    assert any(
        t.startswith(f"Fault {fault['FaultId']} injected: S3Errors (0.3 of S3 requests answered 503 SlowDown")
        for t in texts
    )


def test_an_s3_fault_ends_by_itself_after_its_duration(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient
) -> None:
    cluster(sm, agent_plane, "brief", 1)
    fault = client.inject_fault("brief", Type="S3Latency", LatencyMs=50, DurationSeconds=1)
    assert fault["LatencyMs"] == 50
    ended = f"Fault {fault['FaultId']} ended: S3Latency (50 ms per S3 request, for 1 s); its 1 s passed."
    wait_for(
        lambda: any(t.startswith(ended) for t in descriptions(client, "brief")), timeout=30, what="the end"
    )
    assert client.list_faults("brief") == []
    # The end is a new policy generation without the fault, pushed to the agent.
    (node,) = client.list_nodes("brief")
    wait_for(
        lambda: httpx.get(f"{node['AgentStatus']['Endpoint']}/v1/policy").json()["faults"] == {"s3": None},
        timeout=30,
        what="the agent to drop the fault",
    )


# ---------------------------------------------------------------------- the API surface


def test_validation_and_unknown_resources(agent_plane: ControlPlane, sm: Any) -> None:
    (node,) = cluster(sm, agent_plane, "checks", 1)
    base = f"{agent_plane.url}/clusters/checks/faults"

    def refused(body: Any, status: int = 400) -> dict[str, Any]:
        response = httpx.post(base, json=body)
        assert response.status_code == status, response.text
        answer: dict[str, Any] = response.json()
        return answer

    assert refused({"Type": "Meteor"}) == {
        "__type": "ValidationException",
        "message": "1 validation error detected: Value 'Meteor' at 'type' failed to satisfy constraint: "
        "Member must satisfy enum value set: "
        "[AgentCrash, NodeLoss, AgentHang, NetworkPartition, S3Latency, S3Errors, S3Outage, "
        "DeepHealthCheckFailure]",
    }
    assert refused({"Type": "AgentHang", "InstanceId": node["InstanceId"]})["message"] == (
        "1 validation error detected: Value null at 'durationSeconds' failed to satisfy constraint: "
        "Member must not be null"
    )
    assert refused({"Type": "S3Errors", "ErrorRate": 1.5, "ErrorKind": "Boom", "LatencyMs": 5})[
        "message"
    ] == (
        "3 validation errors detected: Member 'LatencyMs' does not apply to Type 'S3Errors', which takes "
        "ErrorRate, ErrorKind, DurationSeconds; Value '1.5' at 'errorRate' failed to satisfy constraint: "
        "Member must have value less than or equal to 1; Value 'Boom' at 'errorKind' "
        "failed to satisfy constraint: Member must satisfy enum value set: [Throttle, InternalError]"
    )
    assert "Unknown member 'Colour'" in refused({"Type": "S3Outage", "Colour": "red"})["message"]
    assert refused({"Type": "AgentCrash", "InstanceId": "i-00000000000000000"}, 404) == {
        "__type": "ResourceNotFound",
        "message": "Node 'i-00000000000000000' does not exist in cluster 'checks'.",
    }
    missing = httpx.post(f"{agent_plane.url}/clusters/nope/faults", json={"Type": "S3Outage"})
    assert (missing.status_code, missing.json()["__type"]) == (404, "ResourceNotFound")
    unknown = httpx.delete(f"{base}/f-0000000000000000")
    assert unknown.status_code == 404
    assert unknown.json()["message"] == "Fault 'f-0000000000000000' is not in force in cluster 'checks'."
    # One S3 fault at a time.
    first = httpx.post(base, json={"Type": "S3Outage"})
    assert first.status_code == 201, first.text
    second = refused({"Type": "S3Latency", "LatencyMs": 10}, 409)
    assert second["__type"] == "ConflictException"
    assert first.json()["FaultId"] in second["message"]


def test_node_faults_need_local_agents(control_plane: ControlPlane) -> None:
    sm = control_plane.client()
    sm.create_cluster(
        ClusterName="sim",
        InstanceGroups=[
            {
                "InstanceGroupName": "w",
                "InstanceType": "ml.t3.medium",
                "InstanceCount": 1,
                "ExecutionRole": "arn:aws:iam::123456789012:role/HyperPodExecution",
            }
        ],
    )
    control_plane.settle(sm, "sim")
    node_id = sm.list_cluster_nodes(ClusterName="sim")["ClusterNodeSummaries"][0]["InstanceId"]
    response = httpx.post(
        f"{control_plane.url}/clusters/sim/faults", json={"Type": "AgentCrash", "InstanceId": node_id}
    )
    assert response.status_code == 400
    assert response.json() == {
        "__type": "ValidationException",
        "message": "Fault type 'AgentCrash' acts on a node's agent process, which only the local provisioner "
        "owns; this control plane provisions nodes in 'simulated' mode (HPSIM_PROVISIONING__MODE=local for "
        "node faults). S3 faults work in every mode.",
    }
    # S3 faults are accepted, listed and end on the control plane's clock.
    fault = httpx.post(
        f"{control_plane.url}/clusters/sim/faults", json={"Type": "S3Outage", "DurationSeconds": 30}
    ).json()
    listing = httpx.get(f"{control_plane.url}/clusters/sim/faults").json()
    assert listing == {
        "ClusterName": "sim",
        "Faults": [{k: v for k, v in fault.items() if k not in ("ClusterName", "PolicyGeneration")}],
    }
    control_plane.clock.advance(31)
    assert httpx.get(f"{control_plane.url}/clusters/sim/faults").json()["Faults"] == []


def test_faults_are_in_the_openapi_document(agent_plane: ControlPlane) -> None:
    paths = httpx.get(f"{agent_plane.url}/openapi.json", timeout=60).json()["paths"]
    post = paths["/clusters/{name}/faults"]["post"]
    assert "hyperpod-sim extension" in post["summary"]
    content = post["requestBody"]["content"]["application/json"]
    types = content["schema"]["properties"]["Type"]["enum"]
    assert types == [
        "AgentCrash",
        "NodeLoss",
        "AgentHang",
        "NetworkPartition",
        "S3Latency",
        "S3Errors",
        "S3Outage",
        "DeepHealthCheckFailure",
    ]
    assert set(content["examples"]) == set(types)  # an example of each
    assert "get" in paths["/clusters/{name}/faults"]
    assert "delete" in paths["/clusters/{name}/faults/{fault_id}"]
    outage = paths["/faults"]["post"]
    assert "hyperpod-sim extension" in outage["summary"]
    content = outage["requestBody"]["content"]["application/json"]
    assert content["schema"]["properties"]["Type"]["enum"] == ["DatabaseOutage", "DatabaseHang"]
    assert set(content["examples"]) == {"DatabaseOutage", "DatabaseHang"}
    assert "get" in paths["/faults"]
    assert "delete" in paths["/faults/{fault_id}"]


def test_fault_commands(agent_plane: ControlPlane, sm: Any) -> None:
    cluster(sm, agent_plane, "cli", 1)
    injected = ok(
        hpsim(agent_plane.url, "fault", "inject", "cli", "--type", "S3Errors", "--error-rate", "0.5")
    )
    fault_id = next(line.split()[-1] for line in injected.splitlines() if line.startswith("Fault:"))
    assert "rate 0.5 Throttle, until cleared" in injected
    listing = ok(hpsim(agent_plane.url, "fault", "list", "cli"))
    assert listing.splitlines()[0].split() == ["FAULT", "TYPE", "NODE", "DETAILS", "INJECTED", "ENDS"]
    assert fault_id in listing
    assert ok(hpsim(agent_plane.url, "fault", "clear", "cli", fault_id)) == f"{fault_id} (S3Errors) cleared\n"
    assert ok(hpsim(agent_plane.url, "fault", "list", "cli")) == "Cluster cli has no faults in force.\n"
    bad = hpsim(agent_plane.url, "fault", "inject", "cli", "--type", "AgentHang", "--instance-id", "i-1")
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: ValidationException: 1 validation error detected: Value null at ")
    assert members(agent_plane, "cli")
