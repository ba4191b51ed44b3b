"""The in-memory checkpoint tier of the agents, through its HTTP protocol (the one the
amzn-sagemaker-checkpointing library speaks), with real agent processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from tests.conftest import ROLE, ControlPlane, launch_secret, shm_root_for, wait_for
from tests.tier import cluster, create_namespace, get, latest, members, meta, metric, put, replicated, url

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def test_cluster_wide_namespace_and_shards(agent_plane: ControlPlane, sm: Any) -> None:
    a, b = (url(n) for n in cluster(sm, agent_plane, "wide", 2))
    assert create_namespace(a, "job", 3).status_code == 201
    assert create_namespace(b, "job", 3).status_code == 409
    assert httpx.get(f"{b}/v1/cp/namespaces/job").json() == {
        "namespace": "job",
        "num_ranks": 3,
        "steps_to_retain_per_rank": 3,
    }
    assert httpx.get(f"{b}/v1/cp/namespaces/nope").status_code == 404
    shards = {r: os.urandom(100_000 + r) for r in range(3)}
    # Ranks on different nodes, each through its own node's agent; the metadata rank through a.
    assert put(a, "job", 0, 1, shards[0]).status_code == 200
    assert put(b, "job", 1, 1, shards[1]).status_code == 200
    assert latest(a, "job") == []  # rank 2 (the metadata) is missing: step 1 is not complete
    assert put(a, "job", 2, 1, shards[2]).status_code == 200
    assert latest(a, "job") == [1]
    assert latest(b, "job") == [1]
    for agent in (a, b):
        for rank, data in shards.items():
            response = get(agent, "job", rank, 1)
            assert response.status_code == 200
            assert response.content == data
            assert (
                json.loads(response.headers["Shard-Meta"])["checksum"] == json.loads(meta(data))["checksum"]
            )
    assert get(a, "job", 0, 9).status_code == 404
    bad_rank = put(a, "job", 3, 1, b"x")
    assert bad_rank.status_code == 400
    assert bad_rank.json()["error"] == "InvalidRank"
    # Deleting a shard anywhere removes every copy.
    assert httpx.delete(f"{b}/v1/cp/checkpoints/job/0/1").status_code == 200
    assert get(a, "job", 0, 1).status_code == 404
    assert latest(b, "job") == []
    assert httpx.delete(f"{b}/v1/cp/namespaces/job").status_code == 200
    assert httpx.get(f"{a}/v1/cp/namespaces/job").status_code == 404


def test_clusters_never_share_namespaces(agent_plane: ControlPlane, sm: Any) -> None:
    (one,) = (url(n) for n in cluster(sm, agent_plane, "one", 1))
    (two,) = (url(n) for n in cluster(sm, agent_plane, "two", 1))
    assert create_namespace(one, "shared-name", 1).status_code == 201
    assert put(one, "shared-name", 0, 1, b"secret").status_code == 200
    assert httpx.get(f"{two}/v1/cp/namespaces/shared-name").status_code == 404
    assert create_namespace(two, "shared-name", 1).status_code == 201
    assert get(two, "shared-name", 0, 1).status_code == 404
    assert latest(two, "shared-name") == []


def test_checksum_mismatch_is_refused(agent_plane: ControlPlane, sm: Any) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "sums", 1))
    create_namespace(a, "job", 1)
    refused = httpx.post(
        f"{a}/v1/cp/checkpoints/job/0/1", content=b"good bytes", headers={"Shard-Meta": meta(b"other")}
    )
    assert refused.status_code == 400
    assert refused.json()["error"] == "ChecksumMismatch"
    assert get(a, "job", 0, 1).status_code == 404
    assert metric(a, "hpsim_tier_bytes_held") == 0
    assert metric(a, "hpsim_tier_checksum_failures_total") == 1
    missing = httpx.post(f"{a}/v1/cp/checkpoints/job/0/1", content=b"no meta")
    assert missing.status_code == 400
    assert missing.json()["error"] == "MissingShardMeta"


def test_corrupted_copy_is_never_served(agent_plane: ControlPlane, sm: Any, tmp_path: Path) -> None:
    nodes = cluster(sm, agent_plane, "rot", 2)
    (a, b), owner = (url(n) for n in nodes), nodes[0]["InstanceId"]
    create_namespace(a, "job", 1)
    data = os.urandom(200_000)
    assert put(a, "job", 0, 1, data).status_code == 200
    wait_for(lambda: replicated(a), timeout=30, what="the replica")
    shard = shm_root_for(tmp_path) / owner / quote("job", safe="") / "0" / "1.shard"
    with open(shard, "r+b") as handle:
        handle.seek(1000)
        handle.write(b"\xff" * 64)
    # The corrupt local copy is detected and dropped; the replica on b serves the read.
    response = get(a, "job", 0, 1)
    assert response.status_code == 200
    assert response.content == data
    assert metric(a, "hpsim_tier_checksum_failures_total") == 1
    assert metric(a, "hpsim_tier_remote_reads_total") == 1
    # With the replica corrupted too, nothing is served.
    replica = shm_root_for(tmp_path) / nodes[1]["InstanceId"] / quote("job", safe="") / "0" / "1.shard"
    with open(replica, "r+b") as handle:
        handle.write(b"\x00" * 64)
    assert get(b, "job", 0, 1).status_code == 404
    assert get(a, "job", 0, 1).status_code == 404


def test_budget_retention_and_507(agent_plane: ControlPlane, sm: Any) -> None:
    # ml.t3.medium has 4 GiB; 20 % of it at the default scale of 1/1024 is 838,860 bytes.
    (a,) = (url(n) for n in cluster(sm, agent_plane, "tight", 1, instance_type="ml.t3.medium"))
    budget = int(4 * 2**30 * 0.2 / 1024)
    assert metric(a, "hpsim_tier_budget_bytes") == budget
    create_namespace(a, "job", 1, steps_retained=3)
    shard = 250_000
    for step in (1, 2, 3):
        assert put(a, "job", 0, step, os.urandom(shard)).status_code == 200
    assert latest(a, "job") == [3, 2, 1]
    # A fourth step: retention (3 steps) drops step 1.
    assert put(a, "job", 0, 4, os.urandom(shard)).status_code == 200
    assert latest(a, "job") == [4, 3, 2]
    # A bigger shard needs more room than retention left: older steps go first, never the
    # newest complete one (4).
    assert put(a, "job", 0, 5, os.urandom(500_000)).status_code == 200
    held = latest(a, "job")
    assert held[0] == 5
    assert 4 in held
    assert 2 not in held
    assert metric(a, "hpsim_tier_bytes_held") <= budget
    # More than the whole budget: 507 with the numbers, and nothing is lost.
    too_big = put(a, "job", 0, 6, os.urandom(budget + 1))
    assert too_big.status_code == 507
    body = too_big.json()
    assert body["needed"] == budget + 1
    assert body["budget"] == budget
    assert body["in_use"] == metric(a, "hpsim_tier_bytes_held")
    assert latest(a, "job")[0] == 5


def test_budget_shrinks_with_the_policy(agent_plane: ControlPlane, sm: Any) -> None:
    (a,) = (
        url(n) for n in cluster(sm, agent_plane, "shrink", 1, instance_type="ml.t3.medium", percentage=40)
    )
    create_namespace(a, "job", 1)
    for step in (1, 2, 3):
        assert put(a, "job", 0, step, os.urandom(400_000)).status_code == 200
    # Three shards and the rank's spare for its next save (retention 3 + 1 files).
    assert metric(a, "hpsim_tier_bytes_held") - metric(a, "hpsim_tier_spare_bytes") == 1_200_000
    assert metric(a, "hpsim_tier_spare_bytes") == 400_000
    sm.update_cluster(
        ClusterName="shrink", TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20}
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName="shrink")["ClusterStatus"] == "InService",
        timeout=60,
        what="update",
    )
    assert metric(a, "hpsim_tier_budget_bytes") == int(4 * 2**30 * 0.2 / 1024)
    assert metric(a, "hpsim_tier_bytes_held") <= metric(a, "hpsim_tier_budget_bytes")
    assert latest(a, "job")[0] == 3  # the newest complete step survives


def test_disabled_tier_answers_503(agent_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(
        ClusterName="off",
        InstanceGroups=[
            {
                "InstanceGroupName": "w",
                "InstanceType": "ml.t3.medium",
                "InstanceCount": 1,
                "ExecutionRole": ROLE,
            }
        ],
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName="off")["ClusterStatus"] == "InService",
        timeout=60,
        what="InService",
    )
    (a,) = (url(n) for n in members(agent_plane, "off"))
    response = httpx.get(f"{a}/v1/cp/namespaces/job")
    assert response.status_code == 503
    assert "tiered storage is off" in response.json()["message"]


def test_read_from_replica_after_the_owner_is_killed(agent_plane: ControlPlane, sm: Any) -> None:
    nodes = cluster(sm, agent_plane, "survive", 2, recovery="None")
    a, b = (url(n) for n in nodes)
    create_namespace(a, "job", 2)
    data = {r: os.urandom(300_000) for r in range(2)}
    for rank, blob in data.items():
        assert put(a, "job", rank, 7, blob).status_code == 200
    wait_for(lambda: replicated(a), timeout=30, what="the replicas")
    for pid in find_agent_pids(nodes[0]["InstanceId"]):
        os.kill(pid, signal.SIGKILL)
    assert latest(b, "job") == [7]
    for rank, blob in data.items():
        response = get(b, "job", rank, 7)
        assert response.status_code == 200
        assert response.content == blob


# The killed agent is not restarted (the control plane would restart it on the same node).
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_replacement_rebuilds_the_replicas_it_should_hold(agent_plane: ControlPlane, sm: Any) -> None:
    nodes = cluster(sm, agent_plane, "rebuild", 3)
    ids = [n["InstanceId"] for n in nodes]
    first = url(nodes[0])
    create_namespace(first, "job", 1)
    data = os.urandom(123_456)
    assert put(first, "job", 0, 1, data).status_code == 200
    wait_for(lambda: replicated(first), timeout=30, what="the replica")
    # Which node holds the replica of the first node's shard? Its ring successor; kill that one.
    holders = [n for n in nodes[1:] if metric(url(n), "hpsim_tier_shards") == 1]
    assert len(holders) == 1
    victim = holders[0]["InstanceId"]
    for pid in find_agent_pids(victim):
        os.kill(pid, signal.SIGKILL)

    def rebuilt() -> bool:
        current = {n["InstanceId"]: n for n in members(agent_plane, "rebuild")}
        fresh = [n for node_id, n in current.items() if node_id not in ids]
        if victim in current or len(fresh) != 1:
            return False
        agent = url(fresh[0])
        try:
            return metric(agent, "hpsim_tier_shards") == 1 and replicated(first)
        except httpx.HTTPError:
            return False

    wait_for(rebuilt, timeout=90, what="the replacement node to hold the replica again")
    fresh = next(n for n in members(agent_plane, "rebuild") if n["InstanceId"] not in ids)
    response = httpx.get(
        f"{url(fresh)}/v1/internal/shards/job/0/1",
        headers={
            "Authorization": f"Bearer {agent_plane.services.clusters.agent_bootstrap(name='rebuild').token}"
        },
    )
    assert response.status_code == 200
    assert response.content == data


# The killed agent is not restarted (the control plane would restart it on the same node).
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_restarted_agent_restores_missing_replicas(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    nodes = cluster(sm, agent_plane, "restart", 2, recovery="None")
    (a, b), owner = (url(n) for n in nodes), nodes[0]["InstanceId"]
    create_namespace(a, "job", 1)
    data = os.urandom(150_000)
    assert put(a, "job", 0, 3, data).status_code == 200
    wait_for(lambda: replicated(a), timeout=30, what="the replica")
    token = agent_plane.services.clusters.agent_bootstrap(name="restart").token
    auth = {"Authorization": f"Bearer {token}"}
    # The replica is lost (as if the owner crashed before sending it)...
    assert httpx.delete(f"{b}/v1/internal/shards/job/0/3", headers=auth).status_code == 200
    assert metric(b, "hpsim_tier_shards") == 0
    # ...and the owner's agent crashes and comes back on the same node, same shared memory.
    (pid,) = find_agent_pids(owner)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not find_agent_pids(owner), timeout=30, what="the agent to die")
    # Started as the provisioner starts one: with a new launch secret (the old one is spent).
    environ[b"HPSIM_AGENT_TOKEN"] = launch_secret(agent_plane, owner).encode()
    with open(tmp_path / "restarted.log", "wb") as log:
        restarted = subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: metric_or_zero(b, "hpsim_tier_shards") == 1, timeout=60, what="the replica restored")
        response = httpx.get(f"{b}/v1/internal/shards/job/0/3", headers=auth)
        assert response.content == data
    finally:
        restarted.kill()
        restarted.wait(timeout=30)


def metric_or_zero(agent: str, name: str) -> float:
    try:
        return metric(agent, name)
    except httpx.HTTPError:
        return 0.0


def test_replicas_are_kept_for_the_namespaces_newest_steps_only(agent_plane: ControlPlane, sm: Any) -> None:
    owner, peer = (url(n) for n in cluster(sm, agent_plane, "trim", 2))
    assert create_namespace(owner, "job", 1, steps_retained=2).status_code == 201
    for step in range(1, 6):
        assert put(owner, "job", 0, step, os.urandom(10_000)).status_code == 200
    wait_for(lambda: replicated(owner), timeout=30, what="the replicas")
    assert latest(owner, "job") == [5, 4]
    # The peer holds replicas of steps 4 and 5 only, as the owner holds its shards.
    assert metric(peer, "hpsim_tier_shards") == 2
    assert get(peer, "job", 0, 5).headers["x-hpsim-tier"] == "replica"
