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
from tests.jobs import run
from tests.s3_checkpoints import markers, set_policy
from tests.tier import cluster, latest, put, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any]) -> dict[str, Any]:
    """S3 for the fallback test: moto behind the test proxy (tests/plugins/s3.py)."""
    return s3_agent_settings


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


def test_a_step_saved_twice_loads_one_save_from_every_node_and_from_s3(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, s3: Any, bucket: str
) -> None:
    n1, n2, n3 = (url(n) for n in cluster(sm, agent_plane, "twice", 3, instance_type="ml.g5.2xlarge"))
    set_policy(agent_plane, sm, "twice", S3BaseUri=f"s3://{bucket}/t", PersistEverySteps=1)
    # Run 1, both ranks on node 1: steps 1-4, then step 5's shards are stored and the coordinator
    # dies in finish, before the metadata.
    died = run(tmp_path, [n1], 2, "job", "--save", "1,2,3,4", "--crash-in-finish", "5", expect_ok=False)
    assert all(r["died_in_finish"] == 5 for r in died)
    wait_for(lambda: 4 in markers(s3, bucket, "t/job/"), timeout=60, what="step 4 on S3")
    # Run 2, the ranks now on node 2: resumes from step 4 and saves step 5 again.
    resumed = run(tmp_path, [n2], 2, "job", "--load", "--run", "2")
    assert all(r["loaded_step"] == 4 and r["loaded_run"] == 1 for r in resumed), resumed
    run(tmp_path, [n2], 2, "job", "--save", "5", "--run", "2")
    wait_for(lambda: 5 in markers(s3, bucket, "t/job/"), timeout=60, what="step 5 on S3")
    # Whichever nodes the ranks restore on, step 5 is run 2's save, whole: rank 0 on node 1
    # (which held run 1's uncommitted step 5) and rank 1 on node 2, then both on node 1.
    for urls in ([n1, n2], [n1]):
        loaded = run(tmp_path, urls, 2, "job", "--load")
        assert [(r["loaded_step"], r["loaded_run"]) for r in loaded] == [(5, 2), (5, 2)], loaded
        assert all(r["skipped"] == {} for r in loaded), loaded
    # Node 1 no longer holds run 1's step 5: another save's shards go once run 2's committed (an
    # agent too busy to answer the drop at once is asked again). It may hold run 2's as a replica
    # of node 2's (where the ring puts node 2's replicas), never run 1's.
    run2 = {rank: httpx.get(f"{n2}/v1/fast/shards/job/{rank}/5").json()["checksum"] for rank in (0, 1)}

    def only_run_2_on_node_1() -> bool:
        held = [httpx.get(f"{n1}/v1/fast/shards/job/{rank}/5") for rank in (0, 1)]
        return all(r.status_code == 404 or r.json()["checksum"] == run2[rank] for rank, r in enumerate(held))

    wait_for(only_run_2_on_node_1, timeout=90, what="run 1's shards of step 5 dropped on node 1")
    # Every copy in memory gone: S3 serves step 5, run 2's save, named by its marker.
    for rank in range(3):
        assert httpx.delete(f"{n1}/v1/cp/checkpoints/job/{rank}/5").status_code == 200
    marker = json.loads(s3.get_object(Bucket=bucket, Key="t/job/_committed/step_5.json")["Body"].read())
    assert marker["save"] is not None
    from_s3 = run(tmp_path, [n3], 2, "job", "--load")
    assert [(r["loaded_step"], r["loaded_run"], r["served_by"]) for r in from_s3] == [
        (5, 2, {"0": "s3"}),
        (5, 2, {"1": "s3"}),
    ], from_s3
