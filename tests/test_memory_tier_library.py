"""The real amzn-sagemaker-checkpointing library against a cluster's agents: multi-rank PyTorch DCP
save (async_save) and load on the gloo backend, several steps, latest and a given step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane
from tests.jobs import agents, run_job

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.mark.parametrize("world_size", [2, 4])
def test_dcp_save_and_load_across_nodes(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, world_size: int
) -> None:
    # Ranks spread over the nodes, each through its own node's agent.
    urls = agents(sm, agent_plane, f"dcp{world_size}", 2)
    results = run_job(tmp_path, urls, world_size, f"job{world_size}", "1,2,3")
    assert all(r["equal"] and r["loaded_step"] == 3 for r in results), results
    # Every step is complete (every rank and the metadata rank) in the cluster-wide view.
    latest = httpx.get(f"{urls[1]}/v1/cp/checkpoints/job{world_size}/latest", params={"limit": 5}).json()
    assert latest == [3, 2, 1]
    # A given (older) step loads too.
    again = run_job(tmp_path, urls, world_size, f"job{world_size}", "", load_step=2)
    assert all(r["equal"] and r["loaded_step"] == 2 for r in again), again


def test_dcp_with_every_rank_on_one_agent(agent_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    urls = agents(sm, agent_plane, "single", 2)
    results = run_job(tmp_path, urls[:1], 2, "solo", "5,6")
    assert all(r["equal"] and r["loaded_step"] == 6 for r in results), results
    # The other agent answers for the namespace too.
    assert httpx.get(f"{urls[1]}/v1/cp/checkpoints/solo/latest").json() == [6, 5]
