"""The SDK's DCP writer and reader against a cluster's real agents: round trips with 1, 2 and 4
ranks over the shared-memory fast path and over HTTP, async_save, a crash before commit, the
fallback order memory -> replica -> S3, and resume from the newest complete step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane, wait_for
from tests.helpers import run_ranks
from tests.test_memory_tier import cluster, latest, put, replicated, url
from tests.test_s3_tier import agent_settings, bucket, markers, moto_url, proxy, s3, set_policy

# S3 for the fallback test: moto behind the test proxy (the fixtures of test_s3_tier).
__all__ = ["agent_settings", "bucket", "moto_url", "proxy", "s3"]

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def run(
    tmp_path: Path, urls: list[str], world: int, ns: str, *args: str, expect_ok: bool = True
) -> list[dict[str, Any]]:
    """One job: ``world`` rank processes, rank r through urls[r % len(urls)]."""
    job = run_ranks(tmp_path, "tests.sdk_worker", urls, world, ns, *args, append_logs=True)
    if expect_ok:
        return job.results()
    return [json.loads(out.read_text()) for out in job.outs]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_round_trip_fast_path_and_http(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, world: int
) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, f"rt{world}", 2, instance_type="ml.g5.2xlarge")]
    modes = {"fast": (), "async": ("--async",), "http": ("--http",)}
    for mode, flags in modes.items():
        ns = f"{mode}{world}"
        results = run(tmp_path, urls, world, ns, "--save", "1,2,3", "--load", *flags)
        # Every rank got back exactly the state it saved at step 3 (model, Adam state, plain values).
        assert all(r["saved"] == [1, 2, 3] for r in results)
        assert all(r["equal"] and r["loaded_step"] == 3 for r in results), results
        # The fast path was used where asked for: ranks read their own node's memory directly.
        assert all(r["fast_path"] == (mode != "http") for r in results)
        assert all(r["served_by"][str(r["rank"])] == "memory" for r in results if r["rank"] < len(urls))
        assert latest(urls[0], ns)[:3] == [3, 2, 1]


def test_a_crash_before_commit_never_yields_a_half_step(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, "crash", 2, instance_type="ml.g5.2xlarge")]
    run(tmp_path, urls, 2, "job", "--save", "1,2", "--async")
    # Both ranks stage step 3 into shared memory and die before anything is committed.
    staged = run(tmp_path, urls, 2, "job", "--crash-before-commit", "3")
    assert all(r["staged"] for r in staged)
    assert latest(urls[0], "job")[:2] == [2, 1]
    resumed = run(tmp_path, urls, 2, "job", "--load")
    assert all(r["equal"] and r["loaded_step"] == 2 for r in resumed), resumed


def corrupt(agent: str, ns: str, rank: int, step: int) -> None:
    """Flip bytes in the middle of the copy that ``agent`` holds, in its shared memory."""
    where = httpx.get(f"{agent}/v1/fast/shards/{ns}/{rank}/{step}").json()
    with open(where["path"], "r+b") as handle:
        handle.seek(where["size"] // 2)
        handle.write(b"\xff\x00corrupted\x00\xff")


def test_fallback_memory_then_replica_then_s3(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, s3: Any, bucket: str
) -> None:
    a, b = (url(n) for n in cluster(sm, agent_plane, "tiers", 2, instance_type="ml.g5.2xlarge"))
    set_policy(agent_plane, sm, "tiers", S3BaseUri=f"s3://{bucket}/t", PersistEverySteps=1)
    run(tmp_path, [a], 1, "job", "--save", "1")
    wait_for(lambda: markers(s3, bucket, "t/job/") == [1], timeout=60, what="step 1 on S3")
    wait_for(lambda: replicated(a), timeout=30, what="replicas on b")
    first = run(tmp_path, [a], 1, "job", "--load")[0]
    assert (first["equal"], first["served_by"]) == (True, {"0": "memory"})
    # This node's copy is corrupted: the replica on the other node serves, and the bad copy is gone.
    corrupt(a, "job", 0, 1)
    second = run(tmp_path, [a], 1, "job", "--load")[0]
    assert (second["equal"], second["loaded_step"], second["served_by"]) == (True, 1, {"0": "replica"})
    assert httpx.get(f"{a}/v1/fast/shards/job/0/1").status_code == 404
    # The replica is corrupted too: S3 serves (verified against the commit marker).
    corrupt(b, "job", 0, 1)
    third = run(tmp_path, [a], 1, "job", "--load")[0]
    assert (third["equal"], third["loaded_step"], third["served_by"]) == (True, 1, {"0": "s3"})


def test_resume_picks_the_newest_complete_step(agent_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    urls = [url(n) for n in cluster(sm, agent_plane, "resume", 2, instance_type="ml.g5.2xlarge")]
    run(tmp_path, urls, 2, "job", "--save", "1,2,3")
    # Step 4: only rank 0's shard arrives (rank 1 and the metadata never do): not complete.
    shard = os.urandom(1000)
    assert put(urls[0], "job", 0, 4, shard).status_code == 200
    assert latest(urls[0], "job")[0] == 3
    # Every copy of rank 1's step 3 (its own node's and the replica) goes bad: step 3 is still
    # listed, its read fails, and every rank of the restarted job moves on to step 2 together.
    wait_for(lambda: replicated(urls[1]), timeout=30, what="replicas")
    corrupt(urls[1], "job", 1, 3)
    corrupt(urls[0], "job", 1, 3)
    assert latest(urls[0], "job")[0] == 3
    resumed = run(tmp_path, urls, 2, "job", "--load")
    assert all(r["equal"] and r["loaded_step"] == 2 for r in resumed), resumed
