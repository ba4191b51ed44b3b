"""Node agents as real processes: policy rollout, scaling, failure and recovery, tokens.

Each test runs a control plane with the local provisioner (one agent process per node on a
loopback port) on the real clock, with short heartbeat intervals.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from tests.agents import (
    agent_policy,
    connections_to,
    create_tiered,
    event_texts,
    expected_budget,
    nodes,
    start_agent,
    wait_status,
)
from tests.conftest import (
    ControlPlane,
    ServerProcess,
    group,
    kill_processes_under,
    shm_root_for,
    wait_for,
)

GiB = 2**30


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    """boto3 against the agent control plane (not conftest's simulated one)."""
    return agent_plane.client()


def test_rollout_budget_and_ring(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "ring", 4)
    wait_status(sm, "ring", "InService")
    details = nodes(agent_plane, "ring")
    assert len(details) == 4
    budget = expected_budget("ml.p5.48xlarge", 20)
    assert budget == int(2048 * GiB * 0.2 / 1024)
    policies = {}
    for node in details:
        assert node["InstanceStatus"]["Status"] == "Running"
        assert node["AgentStatus"]["AppliedPolicyGeneration"] == 1
        policy = agent_policy(node)
        assert policy["generation"] == 1
        assert policy["memory_budget_bytes"] == budget
        assert policy["tiered_storage"] == {"enabled": True, "memory_percentage": 20}
        assert policy["node_id"] == node["InstanceId"]
        metrics = httpx.get(f"{node['AgentStatus']['Endpoint']}/metrics", timeout=10).text
        assert "hpsim_agent_policy_generation 1" in metrics
        assert f"hpsim_agent_memory_budget_bytes {budget}" in metrics
        policies[node["InstanceId"]] = policy
    # Replica peers: each node names one peer, adjacent in a ring that covers every node.
    successor = {nid: p["replication"]["peers"][0]["node_id"] for nid, p in policies.items()}
    start = next(iter(successor))
    seen, current = [], start
    for _ in range(4):
        seen.append(current)
        current = successor[current]
    assert current == start
    assert sorted(seen) == sorted(policies)

    # UpdateCluster: the cluster is InService only once every agent applied generation 2. One
    # agent is frozen until the test has looked, so the rollout cannot finish first on a fast
    # machine.
    (frozen,) = find_agent_pids(details[0]["InstanceId"])
    os.kill(frozen, signal.SIGSTOP)
    try:
        tiered = {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 50}
        sm.update_cluster(ClusterName="ring", TieredStorageConfig=tiered)
        assert sm.describe_cluster(ClusterName="ring")["ClusterStatus"] == "Updating"
    finally:
        os.kill(frozen, signal.SIGCONT)
    wait_status(sm, "ring", "InService")
    for node in nodes(agent_plane, "ring"):
        policy = agent_policy(node)
        assert policy["generation"] == 2
        assert policy["memory_budget_bytes"] == expected_budget("ml.p5.48xlarge", 50)
    texts = event_texts(sm, "ring")
    assert "Cluster update started; policy generation 2." in texts
    assert texts[-1] == "Cluster is InService with 4 nodes; policy generation 2 applied on every node."

    # Mode: Disable: every agent drops the tiered-storage role (no budget, no replicas).
    sm.update_cluster(ClusterName="ring", TieredStorageConfig={"Mode": "Disable"})
    wait_status(sm, "ring", "InService")
    for node in nodes(agent_plane, "ring"):
        policy = agent_policy(node)
        assert policy["generation"] == 3
        assert policy["tiered_storage"] == {"enabled": False, "memory_percentage": None}
        assert policy["memory_budget_bytes"] == 0
        assert policy["replication"] == {"factor": 0, "peers": []}


def test_the_control_plane_holds_a_connection_to_each_agent_from_its_registration(
    agent_plane: ControlPlane, sm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The control plane greets each agent once it has registered and holds that connection for
    the node's life (it runs in this process): every rollout pushes over it, the first included;
    on a new connection the agents' side of a push costs three times as much."""
    create_tiered(sm, "kept", 2)
    wait_status(sm, "kept", "InService")

    def held() -> dict[str, set[int]]:
        listed = nodes(agent_plane, "kept")
        return {n["InstanceId"]: connections_to(n["AgentStatus"]["Endpoint"]) for n in listed}

    def one_each() -> dict[str, set[int]] | None:
        found = held()
        return found if all(len(ports) == 1 for ports in found.values()) else None

    greeted = wait_for(one_each, timeout=30, what="one connection held to each agent")

    def roll_out(percentage: int) -> dict[str, set[int]]:
        sm.update_cluster(
            ClusterName="kept",
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
        )
        wait_status(sm, "kept", "InService")
        for node in nodes(agent_plane, "kept"):
            assert agent_policy(node)["memory_budget_bytes"] == expected_budget("ml.p5.48xlarge", percentage)
        return held()

    first = roll_out(30)
    assert first == greeted  # the cluster's first rollout, on the greeting's connections
    assert roll_out(40) == first

    # An agent killed and started again registers anew: its next push goes out on a new
    # connection, without a failed push first.
    victim = next(iter(first))
    (pid,) = find_agent_pids(victim)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: find_agent_pids(victim) not in ([], [pid]), timeout=60, what="the agent's restart")
    wait_for(
        lambda: all(n["AgentStatus"].get("AppliedPolicyGeneration") == 3 for n in nodes(agent_plane, "kept")),
        timeout=60,
        what="the restarted agent's registration",
    )
    with caplog.at_level(logging.INFO, logger="hyperpod_sim.domain.checkpoints.pushes"):
        third = roll_out(50)
    assert third[victim] != first[victim]
    assert len(third[victim]) == 1
    assert not [r.message for r in caplog.records if "failed" in r.message]

    # The node's connection closes when it leaves, every one when the cluster does.
    endpoints = {n["InstanceId"]: n["AgentStatus"]["Endpoint"] for n in nodes(agent_plane, "kept")}
    sm.delete_cluster(ClusterName="kept")
    wait_for(
        lambda: not any(connections_to(e, established=False) for e in endpoints.values()),
        timeout=60,
        what="the held connections closed with the cluster",
    )


# Not about failure detection: a node failed for a few seconds' silence on a loaded machine would
# be replaced, and the nodes compared below would differ (seen once in CI).
@pytest.mark.patient_heartbeats
def test_scaling_starts_and_stops_agent_processes(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "scale", 2)
    wait_status(sm, "scale", "InService")
    before = {n["InstanceId"] for n in nodes(agent_plane, "scale")}
    assert all(find_agent_pids(node_id) for node_id in before)

    sm.update_cluster(ClusterName="scale", InstanceGroups=[group("workers", 3)])
    wait_status(sm, "scale", "InService")
    after = {n["InstanceId"] for n in nodes(agent_plane, "scale")}
    assert before < after
    assert all(find_agent_pids(node_id) for node_id in after)

    sm.update_cluster(ClusterName="scale", InstanceGroups=[group("workers", 1)])
    wait_status(sm, "scale", "InService")
    remaining = {n["InstanceId"] for n in nodes(agent_plane, "scale")}
    assert len(remaining) == 1
    for gone in after - remaining:
        wait_for(lambda gone=gone: not find_agent_pids(gone), timeout=30, what=f"agent of {gone} to stop")

    victim = remaining.pop()
    sm.batch_delete_cluster_nodes(ClusterName="scale", NodeIds=[victim])
    wait_for(lambda: not find_agent_pids(victim), timeout=30, what="deleted node's agent to stop")

    sm.delete_cluster(ClusterName="scale")
    wait_for(
        lambda: not sm.list_clusters(NameContains="scale")["ClusterSummaries"], timeout=60, what="deletion"
    )


# A killed agent is not restarted here (the control plane would restart it on the same node;
# tests/test_faults.py): its node fails by the heartbeat timeout.
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_killed_agent_is_replaced(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "heal", 3, NodeRecovery="Automatic")
    wait_status(sm, "heal", "InService")
    victim = nodes(agent_plane, "heal")[0]["InstanceId"]
    for pid in find_agent_pids(victim):
        os.kill(pid, signal.SIGKILL)

    def replaced() -> bool:
        current = {n["InstanceId"] for n in nodes(agent_plane, "heal")}
        return victim not in current and len(current) == 3

    wait_for(replaced, timeout=60, what="the failed node to be replaced")

    def healed() -> bool:
        # The cluster stays InService while a node is replaced; the ring changed once, so every
        # agent ends on generation 2.
        details = nodes(agent_plane, "heal")
        return len(details) == 3 and all(
            n["InstanceStatus"]["Status"] == "Running" and agent_policy(n)["generation"] == 2 for n in details
        )

    wait_for(healed, timeout=60, what="the replacement to run and every agent to apply generation 2")
    assert sm.describe_cluster(ClusterName="heal")["ClusterStatus"] == "InService"
    texts = event_texts(sm, "heal")
    failed = [t for t in texts if t.startswith(f"Node {victim} failed: no heartbeat")]
    assert failed, texts
    assert any(t.startswith(f"Node {victim} is replaced by i-") for t in texts), texts


# A killed agent is not restarted here (the control plane would restart it on the same node;
# tests/test_faults.py): its node fails by the heartbeat timeout.
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_failed_node_without_recovery_stays_failed(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "keep", 2, NodeRecovery="None")
    wait_status(sm, "keep", "InService")
    victim = nodes(agent_plane, "keep")[0]["InstanceId"]
    for pid in find_agent_pids(victim):
        os.kill(pid, signal.SIGKILL)

    def failed() -> dict[str, Any] | None:
        for node in sm.list_cluster_nodes(ClusterName="keep")["ClusterNodeSummaries"]:
            if node["InstanceId"] == victim and node["InstanceStatus"]["Status"] == "Failure":
                return node
        return None

    node = wait_for(failed, timeout=30, what="the node to be marked failed")
    assert node["InstanceStatus"]["Message"] == "Node failed: no heartbeat from its agent for 3 s."
    assert len(sm.list_cluster_nodes(ClusterName="keep")["ClusterNodeSummaries"]) == 2
    result = sm.batch_delete_cluster_nodes(ClusterName="keep", NodeIds=[victim])
    assert result["Successful"] == [victim]
    wait_for(
        lambda: len(sm.list_cluster_nodes(ClusterName="keep")["ClusterNodeSummaries"]) == 1,
        timeout=30,
        what="the failed node to go",
    )


def test_tokens_are_checked_on_both_sides(agent_plane: ControlPlane, sm: Any) -> None:
    create_tiered(sm, "tok", 1)
    wait_status(sm, "tok", "InService")
    node = nodes(agent_plane, "tok")[0]
    node_id, endpoint = node["InstanceId"], node["AgentStatus"]["Endpoint"]
    heartbeat = f"{agent_plane.url}/agent/v1/clusters/tok/nodes/{node_id}/heartbeat"
    body = {"applied_generation": 1}
    missing = httpx.post(heartbeat, json=body)
    assert missing.status_code == 401
    assert missing.json()["error"] == "MissingToken"
    wrong = httpx.post(heartbeat, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    assert wrong.json()["error"] == "InvalidToken"
    policy = {**agent_policy(node), "generation": 99}
    assert httpx.put(f"{endpoint}/v1/policy", json=policy).status_code == 401
    refused = httpx.put(f"{endpoint}/v1/policy", json=policy, headers={"Authorization": "Bearer nope"})
    assert refused.status_code == 403
    assert agent_policy(node)["generation"] == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_rollout_completes_after_control_plane_restart(database_url: str, tmp_path: Path) -> None:
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "120",
        "HPSIM_RECONCILER__INTERVAL_S": "0.2",
    }
    first = ServerProcess(database_url, tmp_path, env).start()
    try:
        sm = first.client()
        create_tiered(sm, "roll", 2)
        wait_status(sm, "roll", "InService")
        agents = [pid for n in nodes(first, "roll") for pid in find_agent_pids(n["InstanceId"])]
        assert len(agents) == 2
        # Freeze the agents so the rollout cannot finish, then crash the control plane mid-rollout.
        for pid in agents:
            os.kill(pid, signal.SIGSTOP)
        sm.update_cluster(
            ClusterName="roll",
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 40},
        )
        first.kill()
        second = ServerProcess(database_url, tmp_path, env, port=first.port).start()
        try:
            sm = second.client()
            assert sm.describe_cluster(ClusterName="roll")["ClusterStatus"] == "Updating"
            for pid in agents:
                os.kill(pid, signal.SIGCONT)
            wait_status(sm, "roll", "InService")
            for node in nodes(second, "roll"):
                policy = agent_policy(node)
                assert policy["generation"] == 2
                assert policy["memory_budget_bytes"] == expected_budget("ml.p5.48xlarge", 40)
        finally:
            second.stop()
    finally:
        first.kill()
        kill_processes_under(tmp_path)


@pytest.mark.parametrize("agent_settings", [{"provisioning": {"mode": "external"}}], indirect=True)
def test_external_agents_bind_to_pending_slots(agent_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    create_tiered(sm, "ext", 2)
    # Nobody starts agents: the nodes wait.
    assert sm.describe_cluster(ClusterName="ext")["ClusterStatus"] == "Creating"
    assert {n["InstanceStatus"]["Status"] for n in nodes(agent_plane, "ext")} == {"Pending"}
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/ext/agent-bootstrap").json()
    assert bootstrap["ControlPlaneUrl"] == agent_plane.url
    wrong = start_agent(agent_plane.url, "ext", "not-the-token", tmp_path / "wrong")
    agents = [
        start_agent(agent_plane.url, "ext", bootstrap["BootstrapToken"], tmp_path / f"a{i}") for i in range(2)
    ]
    try:
        wait_status(sm, "ext", "InService")
        details = nodes(agent_plane, "ext")
        endpoints = {n["AgentStatus"]["Endpoint"] for n in details}
        assert len(endpoints) == 2
        assert all(agent_policy(n)["generation"] == 1 for n in details)
        # The agent with a wrong token bound to nothing and is still waiting.
        assert wrong.poll() is None
        # A deleted node's agent learns it from its next heartbeat and exits.
        victim = details[0]["InstanceId"]
        sm.batch_delete_cluster_nodes(ClusterName="ext", NodeIds=[victim])
        wait_for(
            lambda: sum(a.poll() == 0 for a in agents) == 1,
            timeout=30,
            what="the deleted node's agent to exit",
        )
    finally:
        for process in [wrong, *agents]:
            process.kill()
            process.wait(timeout=30)


def pushes_received(node: dict[str, Any]) -> int:
    metrics = httpx.get(f"{node['AgentStatus']['Endpoint']}/metrics", timeout=10).text
    line = next(line for line in metrics.splitlines() if line.startswith("hpsim_agent_policy_pushes_total "))
    return int(float(line.split()[1]))


@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_two_control_planes_push_once(database_url: str, tmp_path: Path) -> None:
    env = {
        "HPSIM_S3__EMBEDDED": "off",  # one embedded S3 per data dir, and this test needs none
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_RECONCILER__INTERVAL_S": "0.05",
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),  # removed after the test
    }
    # One database, two data dirs: a data dir is one control plane's (hyperpod_sim/serve/process.py).
    first = ServerProcess(database_url, tmp_path / "first", env).start()
    second = ServerProcess(database_url, tmp_path / "second", env).start()
    try:
        sm = first.client()
        create_tiered(sm, "pair", 4)
        wait_status(sm, "pair", "InService")
        before = {n["InstanceId"]: pushes_received(n) for n in nodes(first, "pair")}
        for generation in (2, 3, 4):
            sm.update_cluster(
                ClusterName="pair",
                TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20 + generation},
            )
            wait_status(second.client(), "pair", "InService")
        after = {n["InstanceId"]: pushes_received(n) for n in nodes(second, "pair")}
        # Each agent got each new generation once, from one of the two control planes; an agent
        # that pulled a generation itself before its push got fewer.
        assert all(after[node_id] - before[node_id] <= 3 for node_id in before), (before, after)
        assert all(agent_policy(n)["generation"] == 4 for n in nodes(first, "pair"))
    finally:
        first.stop()
        second.stop()
        kill_processes_under(tmp_path)
