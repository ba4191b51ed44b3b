"""The S3 tier of the agents: complete steps persisted by policy, commit markers, retention, fallback
reads and drains, with real agent processes against moto's S3 server through real HTTP (behind a
proxy that injects S3 faults)."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from tests.conftest import SHARED_NETWORK, ControlPlane, free_port, wait_for
from tests.jobs import agents, run_job
from tests.s3_checkpoints import CREDENTIALS, keys, markers, s3_through_proxy, save_step, set_policy
from tests.s3proxy import FaultyS3Proxy
from tests.tier import cluster, create_namespace, get, latest, meta, metric, put, url

# About checkpoints, not failure detection: on a loaded CI machine both nodes of a test were once
# failed for a few seconds' silence and replaced while a trainer loaded through them (and once in
# stop 33). A killed agent is still restarted at once: that goes by its exit, not its silence.
pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def agent_settings(
    proxy: FaultyS3Proxy, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """S3 through the proxy, with a test's own settings (indirect) on top."""
    return {**s3_through_proxy(proxy, monkeypatch), **getattr(request, "param", {})}


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def marker(s3: Any, bucket: str, key: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    return doc


def running_agent(plane: ControlPlane, name: str, *, other_than: str) -> str | None:
    """The endpoint of a Running node's agent that answers, other than ``other_than``."""
    for node in httpx.get(f"{plane.url}/clusters/{name}/nodes").json()["ClusterNodeSummaries"]:
        endpoint = node.get("AgentStatus", {}).get("Endpoint")
        if node["InstanceStatus"]["Status"] == "Running" and endpoint and endpoint != other_than:
            try:
                if httpx.get(f"{endpoint}/health", timeout=2).status_code == 200:
                    return str(endpoint)
            except httpx.HTTPError:
                pass
    return None


def test_persist_every_n_steps_layout_markers_and_retention(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str
) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "persist", 2)]
    set_policy(
        agent_plane, sm, "persist", S3BaseUri=f"s3://{bucket}/runs", PersistEverySteps=2, S3Retention=2
    )
    assert create_namespace(nodes[0], "job", 3, steps_retained=3).status_code == 201
    saved = {}
    for step in range(1, 7):
        saved[step] = save_step(nodes, "job", step, 2)
        if step % 2 == 0:
            # One persist at a time, the newest due step queued: under load a due step can be
            # superseded by the next one before it starts. Wait, so that every due step goes.
            wait_for(lambda s=step: s in markers(s3, bucket, "runs/job/"), timeout=60, what=f"step {step}")
    wait_for(lambda: markers(s3, bucket, "runs/job/") == [4, 6], timeout=60, what="steps 4 and 6 on S3")
    # Only due steps were persisted, and retention deleted step 2 whole; odd steps never went.
    wait_for(lambda: not keys(s3, bucket, "runs/job/rank_0/step_2/"), timeout=30, what="step 2 deleted")
    assert keys(s3, bucket, "runs/job/") == {
        key
        for step in (4, 6)
        for key in (
            f"runs/job/rank_0/step_{step}/checkpoint.pt",
            f"runs/job/rank_1/step_{step}/checkpoint.pt",
            f"runs/job/rank_0/step_{step}/metadata.metadata",
            f"runs/job/_committed/step_{step}.json",
        )
    }
    # The library's layout holds exactly the bytes saved; the marker lists sizes and checksums.
    doc = marker(s3, bucket, "runs/job/_committed/step_6.json")
    assert (doc["step"], doc["num_ranks"]) == (6, 3)
    for shard in doc["shards"]:
        data = s3.get_object(Bucket=bucket, Key=shard["key"])["Body"].read()
        assert data == saved[6][shard["rank"]]
        assert shard["size"] == len(data)
        assert shard["checksum"] == json.loads(meta(data))["checksum"]
    assert {s["key"].split("/step_6/")[1] for s in doc["shards"]} == {"checkpoint.pt", "metadata.metadata"}
    # Each agent uploaded the ranks it owns: rank 1 was saved through node 1.
    assert metric(nodes[1], "hpsim_s3_uploaded_shards_total") >= 2
    # The node's details show the S3 tier, through the heartbeat.
    # A loaded machine (CI's last minutes) may keep serve's answer past httpx's default 5 s.
    first = httpx.get(f"{agent_plane.url}/clusters/persist/nodes", timeout=30).json()["ClusterNodeSummaries"][
        0
    ]

    def s3_status() -> dict[str, Any] | None:
        node = httpx.get(f"{agent_plane.url}/clusters/persist/nodes/{first['InstanceId']}", timeout=30).json()
        tier: dict[str, Any] | None = node["NodeDetails"]["AgentStatus"].get("S3Tier")
        return tier if tier and tier.get("LastPersistedSteps", {}).get("job") == 6 else None

    status = wait_for(s3_status, timeout=30, what="S3Tier in the node's AgentStatus")
    assert status["PendingSteps"] == 0


def test_multipart_shard_and_fallback_reads(agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "fallback", 2)]
    set_policy(agent_plane, sm, "fallback", S3BaseUri=f"s3://{bucket}", PersistEverySteps=1)
    assert create_namespace(nodes[0], "big", 2).status_code == 201
    big = os.urandom(40 * 1024 * 1024 + 7)  # three parts of 16 MiB
    assert put(nodes[1], "big", 0, 5, big).status_code == 200
    assert put(nodes[0], "big", 1, 5, b"metadata").status_code == 200
    wait_for(lambda: markers(s3, bucket, "big/") == [5], timeout=60, what="step 5 on S3")
    assert s3.get_object(Bucket=bucket, Key="big/rank_0/step_5/checkpoint.pt")["Body"].read() == big
    # Wipe memory and replicas: every copy of the shards, on every agent.
    for rank in (0, 1):
        assert httpx.delete(f"{nodes[0]}/v1/cp/checkpoints/big/{rank}/5").status_code == 200
    # latest still lists the step (from S3), and reads fall back to S3, through any agent.
    assert latest(nodes[1], "big") == [5]
    for node in nodes:
        response = get(node, "big", 0, 5)
        assert response.status_code == 200
        assert response.content == big
        assert json.loads(response.headers["Shard-Meta"])["checksum"] == json.loads(meta(big))["checksum"]
    assert metric(nodes[0], "hpsim_s3_fallback_reads_total") >= 1
    # A corrupted S3 object is never served.
    s3.put_object(Bucket=bucket, Key="big/rank_0/step_5/checkpoint.pt", Body=b"garbage")
    assert get(nodes[0], "big", 0, 5).status_code == 404
    assert get(nodes[0], "big", 1, 5).content == b"metadata"


def test_s3_faults_are_retried_and_never_leave_a_false_marker(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str, proxy: FaultyS3Proxy
) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "faults", 2)]
    set_policy(agent_plane, sm, "faults", S3BaseUri=f"s3://{bucket}/f", PersistEverySteps=1)
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    # A third of all S3 requests throttled or failing: botocore's retries get everything through.
    chance = random.Random(7)
    proxy.fault = lambda method, path: chance.choice(["pass", "pass", "throttle", "error", "pass"])
    saved = save_step(nodes, "job", 1, 2, size=3 * 1024 * 1024)
    wait_for(lambda: markers(s3, bucket, "f/job/") == [1], timeout=90, what="step 1 on S3 despite faults")
    assert proxy.count("throttle") + proxy.count("error") > 0
    for shard in marker(s3, bucket, "f/job/_committed/step_1.json")["shards"]:
        assert s3.get_object(Bucket=bucket, Key=shard["key"])["Body"].read() == saved[shard["rank"]]
    # A full outage: saves in memory go on; nothing is reported on S3; the tier shows the lag.
    proxy.fault = lambda method, path: "error"
    save_step(nodes, "job", 2, 2)
    wait_for(lambda: metric(nodes[0], "hpsim_s3_failures_total") >= 1, timeout=60, what="a failed persist")
    assert metric(nodes[0], "hpsim_s3_pending_steps") >= 1
    assert latest(nodes[0], "job")[0] == 2  # step 2 is readable from memory
    assert markers(s3, bucket, "f/job/") == [1]
    # S3 comes back: the tier catches up on its own.
    proxy.fault = lambda method, path: "pass"
    wait_for(lambda: markers(s3, bucket, "f/job/") == [1, 2], timeout=90, what="catch-up after the outage")
    wait_for(lambda: metric(nodes[0], "hpsim_s3_pending_steps") == 0, timeout=30, what="no lag")


@pytest.mark.parametrize("agent_settings", [SHARED_NETWORK], indirect=True)  # back on a new endpoint
def test_an_upload_that_dies_leaves_no_marker_and_is_cleaned_up(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str, proxy: FaultyS3Proxy
) -> None:
    node = cluster(sm, agent_plane, "crash", 1)[0]
    agent = url(node)
    set_policy(agent_plane, sm, "crash", S3BaseUri=f"s3://{bucket}/c", PersistEverySteps=1)
    assert create_namespace(agent, "job", 3).status_code == 201
    # Step 1's rank 1 upload hangs; the agent dies (SIGKILL) in the middle of it.
    proxy.fault = lambda method, path: "hold" if "rank_1/step_1/" in path else "pass"
    save_step([agent], "job", 1, 2)
    wait_for(lambda: proxy.count("hold") >= 1, timeout=30, what="the upload under way")
    wait_for(
        lambda: "c/job/rank_0/step_1/checkpoint.pt" in keys(s3, bucket, "c/"), timeout=30, what="rank 0 up"
    )
    for pid in find_agent_pids(node["InstanceId"]):
        os.kill(pid, signal.SIGKILL)
    proxy.fault = lambda method, path: "pass"
    proxy.release()
    # No marker: step 1 is not on S3, though some of its objects are.
    assert markers(s3, bucket, "c/job/") == []
    assert "c/job/rank_0/step_1/checkpoint.pt" in keys(s3, bucket, "c/")
    # The node comes back (its agent restarted or the node replaced); step 2 persists, and the
    # leftovers of step 1 are deleted.
    fresh = wait_for(
        lambda: running_agent(agent_plane, "crash", other_than=agent), timeout=90, what="node back"
    )
    save_step([fresh], "job", 2, 2)
    wait_for(lambda: markers(s3, bucket, "c/job/") == [2], timeout=60, what="step 2 on S3")
    wait_for(lambda: not keys(s3, bucket, "c/job/rank_0/step_1/"), timeout=30, what="step 1's leftovers gone")
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix="c/job/").get("Uploads")


def test_drain_on_sigterm_persists_the_newest_complete_step(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str
) -> None:
    members = cluster(sm, agent_plane, "drain", 2)
    nodes = [url(n) for n in members]
    set_policy(agent_plane, sm, "drain", S3BaseUri=f"s3://{bucket}/d", PersistEverySteps=100)
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    for step in (1, 2, 3):
        saved = save_step(nodes, "job", step, 2)
    assert markers(s3, bucket, "d/job/") == []  # not due: only the drain persists it
    for pid in find_agent_pids(members[1]["InstanceId"]):
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: markers(s3, bucket, "d/job/") == [3], timeout=60, what="step 3 drained to S3")
    for shard in marker(s3, bucket, "d/job/_committed/step_3.json")["shards"]:
        assert s3.get_object(Bucket=bucket, Key=shard["key"])["Body"].read() == saved[shard["rank"]]


def test_delete_cluster_and_mode_disable_drain_to_s3(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str
) -> None:
    nodes = [url(n) for n in cluster(sm, agent_plane, "off", 2)]
    set_policy(agent_plane, sm, "off", S3BaseUri=f"s3://{bucket}/off", PersistEverySteps=100)
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    save_step(nodes, "job", 7, 2)
    sm.update_cluster(ClusterName="off", TieredStorageConfig={"Mode": "Disable"})
    wait_for(lambda: markers(s3, bucket, "off/job/") == [7], timeout=60, what="step 7 drained on Disable")

    nodes = [url(n) for n in cluster(sm, agent_plane, "gone", 2)]
    set_policy(agent_plane, sm, "gone", S3BaseUri=f"s3://{bucket}/gone", PersistEverySteps=100)
    assert create_namespace(nodes[0], "job", 3).status_code == 201
    save_step(nodes, "job", 9, 2)
    sm.delete_cluster(ClusterName="gone")
    wait_for(lambda: markers(s3, bucket, "gone/job/") == [9], timeout=60, what="step 9 drained on delete")


def test_a_drain_that_cannot_reach_s3_is_reported(
    agent_plane: ControlPlane, sm: Any, bucket: str, proxy: FaultyS3Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = cluster(sm, agent_plane, "lost", 1)
    agent = url(members[0])
    set_policy(agent_plane, sm, "lost", S3BaseUri=f"s3://{bucket}/l", PersistEverySteps=100)
    assert create_namespace(agent, "job", 2).status_code == 201
    save_step([agent], "job", 4, 1)
    proxy.fault = lambda method, path: "error"
    for pid in find_agent_pids(members[0]["InstanceId"]):
        os.kill(pid, signal.SIGTERM)

    def reported() -> dict[str, Any] | None:
        events = sm.list_cluster_events(ClusterName="lost")["Events"]
        return next((e for e in events if "could not persist step 4" in e.get("Description", "")), None)

    event = wait_for(reported, timeout=90, what="the drain failure as a cluster event")
    assert members[0]["InstanceId"] in event["Description"]


def test_the_library_reads_from_s3_what_the_agents_persisted(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str, moto_url: str, tmp_path: Path
) -> None:
    """The public library saves through the agents (in-memory tier); the agents persist to S3; then
    the library's reader, with the same S3 base path and no in-memory tier at all, loads the newest
    step through its own S3 code (s3torchconnector and boto3, pointed at the endpoint by
    AWS_ENDPOINT_URL)."""
    urls = agents(sm, agent_plane, "lib", 2)
    set_policy(agent_plane, sm, "lib", S3BaseUri=f"s3://{bucket}/lib", PersistEverySteps=2)
    saved = run_job(tmp_path, urls, 2, "libjob", "1,2,3")
    assert all(r["equal"] for r in saved), saved
    wait_for(lambda: markers(s3, bucket, "lib/libjob/") == [2], timeout=60, what="step 2 on S3")
    nowhere = f"http://127.0.0.1:{free_port()}"  # no agent listens: the in-memory tier is empty
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": moto_url}
    loaded = run_job(
        tmp_path,
        [nowhere],
        2,
        "libjob",
        "",
        extra=("--s3-base", f"s3://{bucket}/lib", "--expect-step", "2"),
        env=env,
    )
    assert all(r["equal"] and r["loaded_step"] == 2 for r in loaded), loaded


def test_steps_the_library_wrote_to_s3_itself_are_seen_and_loaded(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str, moto_url: str, tmp_path: Path
) -> None:
    """The library with save_to_s3=True writes S3 itself, without a commit marker (its in-memory
    tier unreachable here, so S3 alone holds the steps): the agents' latest and S3 fallback, the
    listing (marked as written by the trainer) and the SDK's load_latest, through an agent and
    straight from S3, see and load them, byte-identical."""
    urls = agents(sm, agent_plane, "libs3", 2)
    base = f"s3://{bucket}/lib"
    set_policy(agent_plane, sm, "libs3", S3BaseUri=base, PersistEverySteps=1000)  # only the trainer writes
    world = 2
    assert create_namespace(urls[0], "trainer", world + 1).status_code in (200, 201)
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": moto_url}
    # The library's in-memory tier is unreachable: its writer puts each step on S3 only.
    nowhere = f"http://127.0.0.1:{free_port()}"
    saved = run_job(
        tmp_path, [nowhere], world, "trainer", "1,2", extra=("--s3-base", base, "--save-to-s3"), env=env
    )
    assert all(r["equal"] for r in saved), saved  # (the library's own reader, from S3)
    written = keys(s3, bucket, "lib/trainer/")
    assert "lib/trainer/rank_1/step_2/checkpoint.pt" in written
    assert "lib/trainer/rank_0/step_2/metadata.metadata" in written
    assert not any("_committed" in key for key in written)

    # The agents' latest (every agent) and the listing, marked as written by the trainer.
    for agent in urls:
        assert httpx.get(f"{agent}/v1/cp/checkpoints/trainer/latest").json() == [2, 1]
    listing = httpx.get(f"{agent_plane.url}/clusters/libs3/checkpoints").json()
    (namespace,) = [n for n in listing["Namespaces"] if n["Namespace"] == "trainer"]
    assert [(s["Step"], s["S3"], s.get("S3WrittenBy"), s["Complete"]) for s in namespace["Steps"]] == [
        (2, True, "Trainer", True),
        (1, True, "Trainer", True),
    ]

    # The SDK's load_latest through an agent (its S3 fallback), then straight from S3.
    sdk = ("--sdk-load", "--expect-step", "2")
    through_agents = run_job(tmp_path, urls, world, "trainer", "", extra=sdk, env=env)
    assert all(r["equal"] and r["sdk_step"] == r["loaded_step"] == 2 for r in through_agents), through_agents
    assert all(set(r["served_by"].values()) == {"s3"} for r in through_agents), through_agents
    direct = run_job(
        tmp_path, [nowhere], world, "trainer", "", 1, extra=("--s3-base", base, "--sdk-load"), env=env
    )
    assert all(r["equal"] and r["sdk_step"] == 1 for r in direct), direct
    assert all(set(r["served_by"].values()) == {"s3-direct"} for r in direct), direct


def test_the_ray_layout_written_by_the_agents_and_by_the_trainer(
    agent_plane: ControlPlane, sm: Any, s3: Any, bucket: str, moto_url: str, tmp_path: Path
) -> None:
    """With S3Layout Ray the agents persist as the library does under Ray Train, and the library's
    Ray reader loads that from S3 alone; a step the library writes itself in that layout is seen
    too. The listing reads both, marked by who wrote them."""
    urls = agents(sm, agent_plane, "ray", 2)
    base = f"s3://{bucket}/ray"
    set_policy(agent_plane, sm, "ray", S3BaseUri=base, PersistEverySteps=2, S3Layout="Ray")
    assert httpx.get(f"{agent_plane.url}/clusters/ray/checkpoint-policy").json()["S3Layout"] == "Ray"
    saved = run_job(tmp_path, urls, 2, "rayjob", "1,2,3")
    assert all(r["equal"] for r in saved), saved
    wait_for(lambda: markers(s3, bucket, "ray/rayjob/") == [2], timeout=60, what="step 2 on S3")
    written = keys(s3, bucket, "ray/rayjob/")
    assert {"ray/rayjob/step_2/rank_1/checkpoint.pt", "ray/rayjob/step_2/rank_0/metadata.metadata"} <= written
    assert not any("/rank_0/step_" in key for key in written)
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": moto_url}
    nowhere = f"http://127.0.0.1:{free_port()}"
    ray = ("--s3-base", base, "--ray-layout")
    loaded = run_job(tmp_path, [nowhere], 2, "rayjob", "", extra=(*ray, "--expect-step", "2"), env=env)
    assert all(r["equal"] and r["loaded_step"] == 2 for r in loaded), loaded
    # The library writes step 8 to S3 itself, in the Ray layout (its in-memory tier unreachable).
    saved = run_job(tmp_path, [nowhere], 2, "rayjob", "8", extra=(*ray, "--save-to-s3"), env=env)
    assert all(r["equal"] for r in saved), saved
    assert httpx.get(f"{urls[0]}/v1/cp/checkpoints/rayjob/latest").json()[:2] == [8, 3]
    listing = httpx.get(f"{agent_plane.url}/clusters/ray/checkpoints").json()
    (namespace,) = listing["Namespaces"]
    on_s3 = [(s["Step"], s.get("S3WrittenBy")) for s in namespace["Steps"] if s["S3"]]
    assert on_s3 == [(8, "Trainer"), (2, None)], namespace
    # The SDK loads the trainer's Ray-layout step through an agent (its S3 fallback).
    sdk = run_job(tmp_path, urls, 2, "rayjob", "", 8, extra=("--sdk-load",), env=env)
    assert all(r["equal"] and r["sdk_step"] == 8 for r in sdk), sdk
