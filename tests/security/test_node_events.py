"""An agent that joined legitimately (external provisioner, bootstrap token) tries to act for
another node, raw HTTP against a real control plane with a real agent process on the other node:
events reported as the other node, its heartbeats, its policy. Each is refused; what it reports
about itself is recorded as its own node's, whatever node it names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents import create_tiered, nodes, start_agent
from tests.conftest import ControlPlane, free_port, wait_for
from tests.helpers import bearer

# The joined node never heartbeats: a 3 s heartbeat timeout would fail it (and revoke its token)
# while the real agent starts on a loaded machine; nothing here is about failure detection.
pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def instance_events(sm: Any, name: str) -> list[dict[str, Any]]:
    pages = sm.get_paginator("list_cluster_events").paginate(ClusterName=name, ResourceType="Instance")
    return [event for page in pages for event in page["Events"]]


@pytest.mark.parametrize("agent_settings", [{"provisioning": {"mode": "external"}}], indirect=True)
def test_events_and_calls_for_another_node_are_refused(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    create_tiered(sm, "evil", 2)
    bootstrap = httpx.get(f"{agent_plane.url}/clusters/evil/agent-bootstrap").json()["BootstrapToken"]
    api = f"{agent_plane.url}/agent/v1/clusters/evil"
    joined = httpx.post(
        f"{api}/register",
        json={"node_id": None, "endpoint": f"http://127.0.0.1:{free_port()}", "pid": os.getpid()},
        headers=bearer(bootstrap),
        timeout=10,
    )
    assert joined.status_code == 200, joined.text
    mine, my_token = joined.json()["node_id"], joined.json()["node_token"]
    real_agent = start_agent(agent_plane.url, "evil", bootstrap, tmp_path / "real")
    try:

        def other_node() -> str | None:
            others = [n for n in nodes(agent_plane, "evil") if n["InstanceId"] != mine]
            registered = [n for n in others if n.get("AgentStatus", {}).get("Endpoint")]
            return registered[0]["InstanceId"] if registered else None

        other = wait_for(other_node, timeout=60, what="the real agent to take the other node")

        # With its own node token, as the other node: refused.
        forged = {"node_id": other, "level": "Error", "message": "Node is on fire."}
        refused = httpx.post(f"{api}/events", json=forged, headers=bearer(my_token), timeout=10)
        assert (refused.status_code, refused.json()["error"]) == (403, "WrongNode")
        assert other in refused.json()["message"]
        for method, path, body in (
            (
                "POST",
                f"/nodes/{other}/heartbeat",
                {"applied_generation": 0, "endpoint": "http://127.0.0.1:9"},
            ),
            ("GET", f"/nodes/{other}/policy", None),
        ):
            response = httpx.request(method, f"{api}{path}", json=body, headers=bearer(my_token), timeout=10)
            assert (response.status_code, response.json()["error"]) == (403, "WrongNode"), path
        # With the tokens every agent of the cluster holds: refused too.
        for token in (joined.json()["cluster_token"], bootstrap, None):
            response = httpx.post(f"{api}/events", json=forged, headers=bearer(token), timeout=10)
            assert response.status_code == (401 if token is None else 403)
        # Nothing of it was recorded (the cluster's own events, such as the real agent's node coming
        # up, may still arrive meanwhile: only the forged one is looked for).
        assert [e for e in instance_events(sm, "evil") if e["Description"] == forged["message"]] == []

        # What it reports about itself is its own node's.
        own = httpx.post(
            f"{api}/events",
            json={"level": "Warn", "message": "Step 5 was not persisted."},
            headers=bearer(my_token),
        )
        assert own.status_code == 201, own.text
        event = sm.describe_cluster_event(ClusterName="evil", EventId=own.json()["event_id"])["EventDetails"]
        assert (event["InstanceId"], event["Description"]) == (mine, "Step 5 was not persisted.")

        # The other node is still its real agent's, heartbeating at its own endpoint.
        by_id = {n["InstanceId"]: n for n in nodes(agent_plane, "evil")}
        endpoint = by_id[other]["AgentStatus"]["Endpoint"]
        assert httpx.get(f"{endpoint}/health", timeout=10).json()["node_id"] == other
        assert real_agent.poll() is None
    finally:
        real_agent.kill()
        real_agent.wait(timeout=30)
