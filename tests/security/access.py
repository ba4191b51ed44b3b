"""A cluster's AgentAccess (who may write to its agents' checkpoint routes), put and applied."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import ControlPlane, wait_for


def set_access(plane: ControlPlane, sm: Any, name: str, agents: list[str], mode: str) -> None:
    """Put the cluster's AgentAccess and wait until every agent applied it."""
    response = httpx.put(f"{plane.url}/clusters/{name}/checkpoint-policy", json={"AgentAccess": mode})
    assert response.status_code == 200, response.text
    assert response.json()["AgentAccess"] == mode
    for agent in agents:
        wait_for(
            lambda agent=agent: httpx.get(f"{agent}/v1/policy").json()["checkpoint_access"]["mode"] == mode,
            timeout=60,
            what=f"AgentAccess {mode} on {agent}",
        )
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=60,
        what="the rollout",
    )
