"""Resume on another world size: a step saved by a job of one world size loads resharded into a
job of another (DTensor state, gloo on CPU), from the agents' memory and from S3, and a job of the
new world size saves on in the same namespace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.sdk.agent import AgentClient
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ControlPlane, wait_for
from tests.helpers import hpsim, ok, run_ranks
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


def loads(results: list[dict[str, Any]]) -> list[tuple[int, int, bool]]:
    """Each rank's (step loaded, world size that saved it, every tensor and value exact)."""
    return [(r["loaded_step"], r["saved_world_size"], r["equal"]) for r in results]


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
        assert loads(loaded) == [(1, 4, True)] * world
    # The 3-rank job saves on in the same namespace; a 4-rank job (replacements came) loads that.
    job(tmp_path, urls, 3, "job", "--save", "2")
    # latest names each step's world size; the library's view (a job of the namespace's fixed
    # world size, 4) holds only the steps it can read.
    assert AgentClient(urls[1]).latest_sizes("job") == {2: 3, 1: 4}
    assert latest(urls[0], "job") == [1]
    # The checkpoint listing names the world size of a step saved at another than the namespace's.
    (namespace,) = HyperPodClient(agent_plane.url).checkpoints("reshard")["Namespaces"]
    assert namespace["NumRanks"] == 5
    assert [(s["Step"], s.get("WorldSize"), s["Complete"]) for s in namespace["Steps"]] == [
        (2, 3, True),
        (1, None, True),
    ]
    # The CLI shows a WORLD SIZE column for a namespace with such a step.
    lines = ok(hpsim(agent_plane.url, "checkpoints", "reshard")).splitlines()
    assert lines[:2] == [
        "Namespace job: 5 ranks, 3 steps kept in memory",
        "STEP  WORLD SIZE  IN MEMORY  REPLICAS  ON S3  COMPLETE  NOT IN MEMORY",
    ]
    assert [line.split()[:2] for line in lines[2:4]] == [["2", "3"], ["1", "4"]]
    loaded = job(tmp_path, urls, 4, "job", "--load")
    assert loads(loaded) == [(2, 3, True)] * 4


def test_a_step_on_s3_loads_resharded_after_memory_is_wiped(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, s3: Any, bucket: str
) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, "reshards3", 2, instance_type="ml.g5.2xlarge")]
    set_policy(agent_plane, sm, "reshards3", S3BaseUri=f"s3://{bucket}/r", PersistEverySteps=1)
    job(tmp_path, urls, 4, "job", "--save", "1")
    job(tmp_path, urls, 3, "job", "--save", "2")  # with a placeholder at rank 3, the metadata at 4
    wait_for(lambda: markers(s3, bucket, "r/job/") == [1, 2], timeout=90, what="steps 1 and 2 on S3")
    # The memory tier is wiped: every copy of every rank of both steps, on every node.
    for step in (1, 2):
        for rank in range(5):
            assert httpx.delete(f"{urls[0]}/v1/cp/checkpoints/job/{rank}/{step}").status_code == 200
    held = [
        httpx.get(f"{u}/v1/fast/shards/job/{r}/{s}").status_code
        for u in urls
        for r in range(5)
        for s in (1, 2)
    ]
    assert set(held) == {404}
    loaded = job(tmp_path, urls, 2, "job", "--load")
    assert loads(loaded) == [(2, 3, True)] * 2
    assert all(set(r["served_by"].values()) == {"s3"} for r in loaded), loaded
    # The older step, saved by 4 ranks, on 3.
    loaded = job(tmp_path, urls, 3, "job", "--load-step", "1")
    assert loads(loaded) == [(1, 4, True)] * 3
    assert all(set(r["served_by"].values()) == {"s3"} for r in loaded), loaded


def test_fsdp2_training_on_4_ranks_resumes_on_2_with_the_losses_of_an_uninterrupted_run(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, "fsdp", 2, instance_type="ml.g5.2xlarge")]
    whole = tmp_path / "state-after-step-3.pt"

    def fsdp(world: int, label: str, *args: str) -> list[dict[str, Any]]:
        return run_ranks(tmp_path, "tests.fsdp_worker", urls, world, "fsdp", *args, label=label).results()

    # Model + AdamW sharded with fully_shard on 4 ranks: 3 steps, saved; the same state written
    # whole (outside any checkpoint) for the run it is compared with.
    fsdp(4, "first", "--train", "3", "--save-step", "3", "--full-out", str(whole))
    resumed = fsdp(2, "resumed", "--resume", "--train", "3")
    uninterrupted = fsdp(2, "uninterrupted", "--from-full", str(whole), "--train", "3")
    assert [(r["loaded_step"], r["saved_world_size"]) for r in resumed] == [(3, 4), (3, 4)]
    expected = uninterrupted[0]["losses"]
    assert len(set(expected)) == 3  # three steps, three losses: training moves
    assert all(r["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-7) for r in resumed), (
        resumed,
        expected,
    )
