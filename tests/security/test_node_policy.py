"""Forged policy pushes, made the way an attacker would: raw ``PUT /v1/policy`` at a real agent of
a real control plane (local provisioner), with a generation far ahead and a 1-byte budget.

With any token an attacker can hold short of the control plane's own (none, the bootstrap token,
the cluster token every agent has, another node's control-plane token) the agent refuses. With the
node's control-plane token itself (stolen from the database) the push lands: the control plane then
notices that the agent is ahead of every generation it issued, re-syncs it with a reset and records
an event; an UpdateCluster after it ends InService only once every agent really applied it.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from hyperpod_sim.models import Node
from tests.agents import agent_policy, event_texts, expected_budget, nodes, wait_status
from tests.conftest import ControlPlane, wait_for
from tests.tier import cluster, create_namespace, get, put, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]

HUGE = 1_000_000_000


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def forged(node: dict[str, Any]) -> dict[str, Any]:
    return {**agent_policy(node), "generation": HUGE, "memory_budget_bytes": 1}


def push(node: dict[str, Any], doc: dict[str, Any], token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.put(f"{url(node)}/v1/policy", json=doc, headers=headers, timeout=10)


def control_plane_token(plane: ControlPlane, node_id: str) -> str:
    """What an attacker who reads the control plane's database finds for the node."""
    with plane.services.db.read() as session:
        node = session.get(Node, node_id)
        assert node is not None
        assert node.push_token is not None
        return node.push_token


def test_forged_policy_pushes_are_refused(agent_plane: ControlPlane, sm: Any) -> None:
    victim, other = cluster(sm, agent_plane, "forge", 2)
    assert create_namespace(url(victim), "job", 1).status_code == 201
    good = os.urandom(300_000)
    assert put(url(victim), "job", 0, 1, good).status_code == 200
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/forge/agent-bootstrap").json()["BootstrapToken"]
    cluster_token = agent_plane.services.clusters.agent_bootstrap(name="forge").token
    peer_token = control_plane_token(agent_plane, other["InstanceId"])

    for token, status in ((None, 401), (bootstrap, 403), (cluster_token, 403), (peer_token, 403)):
        for query in ("", "?reset=true"):
            response = httpx.put(
                f"{url(victim)}/v1/policy{query}",
                json=forged(victim),
                headers={"Authorization": f"Bearer {token}"} if token else {},
                timeout=10,
            )
            assert response.status_code == status, (token, query, response.text)

    policy = agent_policy(victim)
    assert policy["generation"] == 1
    assert policy["memory_budget_bytes"] == expected_budget("ml.p5.48xlarge", 20)
    # The agent still holds and takes checkpoints: the good one loads byte for byte.
    assert get(url(victim), "job", 0, 1).content == good
    later = os.urandom(300_000)
    assert put(url(victim), "job", 0, 2, later).status_code == 200
    assert get(url(other), "job", 0, 2).content == later


def test_an_agent_ahead_of_the_control_plane_is_re_synced(agent_plane: ControlPlane, sm: Any) -> None:
    victim, other = cluster(sm, agent_plane, "ahead", 2)
    assert create_namespace(url(victim), "job", 1).status_code == 201
    good = os.urandom(300_000)
    assert put(url(victim), "job", 0, 1, good).status_code == 200
    wait_for(lambda: replicated(url(victim)), timeout=30, what="the replica on the other node")

    # The divergence, manufactured with the victim's own control-plane token.
    stolen = control_plane_token(agent_plane, victim["InstanceId"])
    landed = push(victim, forged(victim), stolen)
    assert (landed.status_code, landed.json()) == (200, {"applied_generation": HUGE})

    budget = expected_budget("ml.p5.48xlarge", 20)
    wait_for(
        lambda: (
            (agent_policy(victim)["generation"], agent_policy(victim)["memory_budget_bytes"]) == (1, budget)
        ),
        timeout=30,
        what="the control plane to re-sync the victim to its own generation",
    )
    [event] = [text for text in event_texts(sm, "ahead") if f"generation {HUGE}, ahead" in text]
    assert event == (
        f"The agent of node {victim['InstanceId']} reported policy generation {HUGE}, ahead of this "
        "control plane's 1: a policy it did not get from the control plane. Re-syncing it to generation 1."
    )
    # The good checkpoint loads byte for byte (from the replica, if the 1-byte budget evicted it).
    assert get(url(victim), "job", 0, 1).content == good
    assert get(url(other), "job", 0, 1).content == good

    # Again, and an update right after: InService means every agent applied the update, not that
    # an agent ahead answered "stale".
    assert push(victim, forged(victim), stolen).status_code == 200
    sm.update_cluster(
        ClusterName="ahead",
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 40},
    )
    wait_status(sm, "ahead", "InService")
    for node in nodes(agent_plane, "ahead"):
        policy = agent_policy(node)
        assert policy["generation"] == 2, node["InstanceId"]
        assert policy["memory_budget_bytes"] == expected_budget("ml.p5.48xlarge", 40)
        assert node["AgentStatus"]["AppliedPolicyGeneration"] == 2
    assert get(url(victim), "job", 0, 1).content == good
    fresh = os.urandom(300_000)
    assert put(url(victim), "job", 0, 2, fresh).status_code == 200
    assert get(url(other), "job", 0, 2).content == fresh
