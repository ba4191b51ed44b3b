"""Resume on another world size: a step saved by a job of one world size loads resharded into a
job of another (DTensor state, gloo on CPU), from the agents' memory and from S3, and a job of the
new world size saves on in the same namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane, wait_for
from tests.helpers import run_ranks
from tests.s3_checkpoints import markers, set_policy
from tests.tier import cluster, latest, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any]) -> dict[str, Any]:
    """S3 for the wiped-memory test: moto behind the test proxy (tests/plugins/s3.py)."""
    return s3_agent_settings


def job(tmp_path: Path, urls: list[str], world: int, ns: str, *args: str) -> list[dict[str, Any]]:
    """A DTensor job of ``world`` ranks (tests/reshard_worker.py), rank r through urls[r % len(urls)]."""
    label = f"{ns}-w{world}"
    return run_ranks(tmp_path, "tests.reshard_worker", urls, world, ns, *args, label=label).results()


def test_a_step_loads_on_any_world_size_and_saves_go_on(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, "reshard", 2, instance_type="ml.g5.2xlarge")]
    job(tmp_path, urls, 4, "job", "--save", "1")
    # Two nodes lost, no spares: 2 and 3 ranks load the 4-rank step, each rank its own part.
    for world in (2, 3):
        loaded = job(tmp_path, urls, world, "job", "--load")
        assert [(r["loaded_step"], r["saved_world_size"], r["equal"]) for r in loaded] == [(1, 4, True)] * world
    # The 3-rank job saves on in the same namespace; a 4-rank job (replacements came) loads that.
    job(tmp_path, urls, 3, "job", "--save", "2")
    assert latest(urls[0], "job")[:2] == [2, 1]
    loaded = job(tmp_path, urls, 4, "job", "--load")
    assert [(r["loaded_step"], r["saved_world_size"], r["equal"]) for r in loaded] == [(2, 3, True)] * 4
