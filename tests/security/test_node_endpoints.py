"""Endpoints an agent registers: checked at registration and on every heartbeat (400 otherwise),
and a bad one already stored cannot stop the reconciler: raw HTTP against a real control plane
(external provisioner) with real agent processes.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from hyperpod_sim.domain.errors import AgentProtocolError
from hyperpod_sim.domain.nodes.agents import check_endpoint
from hyperpod_sim.models import Node
from tests.agents import create_tiered, nodes, start_agent, wait_status
from tests.conftest import ControlPlane, free_port, wait_for

EXTERNAL = {"provisioning": {"mode": "external", "heartbeat_timeout_s": 60.0}}
BAD = [
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:0", "the port must be given, 1 to 65535"),
    ("http://127.0.0.1", "the port must be given, 1 to 65535"),
    ("http://127.0.0.1:http", "the port must be 1 to 65535"),
    ("https://127.0.0.1:443", "the scheme must be http"),
    ("ftp://127.0.0.1:21", "the scheme must be http"),
    ("http://:8080", "it has no host"),
    ("http://127.0.0.1:8080/v1/policy", "without a path, query or fragment"),
    ("http://127.0.0.1:8080?x=1", "without a path, query or fragment"),
    ("http://user:pass@127.0.0.1:8080", "it must not carry credentials"),
    ("http://0.0.0.0:8080", "unspecified, multicast or link-local"),
    ("http://169.254.169.254:80", "unspecified, multicast or link-local"),
    ("http://[ff02::1]:80", "unspecified, multicast or link-local"),
    ("http://bad_host!:80", "neither an IP address nor a valid host name"),
    ("http://127.0.0.1:" + "9" * 300, "at most 256 are allowed"),
]


@pytest.mark.parametrize(("endpoint", "why"), BAD)
def test_bad_endpoints_are_refused(endpoint: str, why: str) -> None:
    with pytest.raises(AgentProtocolError) as refused:
        check_endpoint(endpoint, loopback_only=False)
    assert (refused.value.status, refused.value.error) == (400, "InvalidEndpoint")
    assert why in refused.value.message


@pytest.mark.parametrize(
    ("endpoint", "loopback_only", "accepted"),
    [
        ("http://127.0.0.1:41234", True, True),
        ("http://127.0.0.2:41234/", True, True),
        ("http://[::1]:41234", True, True),
        ("http://localhost:41234", True, True),
        ("http://10.0.0.7:9000", True, False),
        ("http://agent-3.cluster.local:9000", True, False),
        ("http://10.0.0.7:9000", False, True),
        ("http://agent-3.cluster.local:9000", False, True),
        ("http://[fd00::7]:9000", False, True),
    ],
)
def test_local_agents_are_on_loopback(endpoint: str, loopback_only: bool, accepted: bool) -> None:
    if accepted:
        assert check_endpoint(endpoint, loopback_only=loopback_only) == endpoint.rstrip("/")
    else:
        with pytest.raises(AgentProtocolError, match="loopback address"):
            check_endpoint(endpoint, loopback_only=loopback_only)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("agent_settings", [EXTERNAL], indirect=True)
def test_a_bad_endpoint_gets_400_and_binds_nothing(agent_plane: ControlPlane, tmp_path: Path) -> None:
    sm = agent_plane.client()
    create_tiered(sm, "ports", 1)
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/ports/agent-bootstrap").json()["BootstrapToken"]
    api = f"{agent_plane.url}/agent/v1/clusters/ports"
    for endpoint, why in BAD[:4]:
        refused = httpx.post(
            f"{api}/register",
            json={"node_id": None, "endpoint": endpoint, "pid": 1},
            headers=bearer(bootstrap),
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == "InvalidEndpoint"
        assert why in refused.json()["message"]
    # The slot is still free: a real agent takes it and the cluster comes up.
    assert [n.get("AgentStatus", {}).get("Endpoint") for n in nodes(agent_plane, "ports")] == [None]
    agent = start_agent(agent_plane.url, "ports", bootstrap, tmp_path / "agent")
    try:
        wait_status(sm, "ports", "InService")
        (node,) = nodes(agent_plane, "ports")
        assert node["AgentStatus"]["Endpoint"].startswith("http://127.0.0.1:")
    finally:
        agent.kill()
        agent.wait(timeout=30)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("agent_settings", [EXTERNAL], indirect=True)
def test_a_heartbeat_cannot_move_a_node_to_a_bad_endpoint(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    create_tiered(sm, "beat", 1)
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/beat/agent-bootstrap").json()["BootstrapToken"]
    api = f"{agent_plane.url}/agent/v1/clusters/beat"
    endpoint = f"http://127.0.0.1:{free_port()}"
    joined = httpx.post(
        f"{api}/register", json={"node_id": None, "endpoint": endpoint, "pid": 1}, headers=bearer(bootstrap)
    )
    assert joined.status_code == 200, joined.text
    node_id, token = joined.json()["node_id"], joined.json()["node_token"]
    moved = httpx.post(
        f"{api}/nodes/{node_id}/heartbeat",
        json={"applied_generation": 1, "endpoint": "http://127.0.0.1:99999"},
        headers=bearer(token),
    )
    assert (moved.status_code, moved.json()["error"]) == (400, "InvalidEndpoint")
    assert nodes(agent_plane, "beat")[0]["AgentStatus"]["Endpoint"] == endpoint


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("agent_settings", [EXTERNAL], indirect=True)
def test_a_bad_stored_endpoint_stops_no_other_cluster(agent_plane: ControlPlane, tmp_path: Path) -> None:
    """The endpoint a control plane before these checks stored: pushing to it fails for its node
    alone (its LastError says why), and the other clusters reconcile as usual."""
    sm = agent_plane.client()
    create_tiered(sm, "broken", 1)
    wait_for(lambda: len(nodes(agent_plane, "broken")) == 1, timeout=30, what="broken's node")
    (broken,) = nodes(agent_plane, "broken")
    now = datetime.now(UTC)
    with agent_plane.services.db.write() as session:
        node = session.get(Node, broken["InstanceId"])
        assert node is not None
        node.endpoint, node.push_token = "http://127.0.0.1:99999", os.urandom(16).hex()
        node.registered_at = node.last_heartbeat = now
    agent_plane.services.reconciler.wake()

    create_tiered(sm, "fine", 1)
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/fine/agent-bootstrap").json()["BootstrapToken"]
    agent = start_agent(agent_plane.url, "fine", bootstrap, tmp_path / "fine")
    try:
        wait_status(sm, "fine", "InService")

        def last_error() -> str | None:
            error = nodes(agent_plane, "broken")[0]["AgentStatus"].get("LastError")
            return str(error) if error else None

        error = wait_for(last_error, timeout=30, what="broken's node to show its push failure")
        assert "ValueError: Port out of range" in error
        assert sm.describe_cluster(ClusterName="broken")["ClusterStatus"] == "Creating"
        # Still reconciling: an update of the good cluster rolls out.
        sm.update_cluster(
            ClusterName="fine",
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 30},
        )
        wait_status(sm, "fine", "InService")
        assert nodes(agent_plane, "fine")[0]["AgentStatus"]["AppliedPolicyGeneration"] == 2
    finally:
        agent.kill()
        agent.wait(timeout=30)
