"""The namespace index (docs/memory-tier.md, "The namespace index"): each namespace's two home
agents know which node holds which (rank, step), so that ``latest`` and reads that miss locally
ask one home instead of every agent; with real agent processes, counted through their /metrics."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.agents import catalog
from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.client import HyperPodClient
from tests.agents import agent_policy
from tests.conftest import ControlPlane, launch_secret, wait_for
from tests.tier import cluster, create_namespace, get, latest, members, metric, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    # A node replaced because a loaded machine delayed its heartbeats would change the members,
    # and so rebuild the homes' views (asking every agent): not what these tests count.
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def total(agents: list[str], name: str) -> float:
    return sum(metric(agent, name) for agent in agents)


def homes_of(nodes: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
    """The nodes that keep ``namespace``'s index, first home first (every agent computes them so)."""
    by_id = {node["InstanceId"]: node for node in nodes}
    return [by_id[node_id] for node_id in catalog.homes(namespace, by_id)]


def test_latest_and_a_remote_read_ask_one_home_not_every_agent(agent_plane: ControlPlane, sm: Any) -> None:
    nodes = cluster(sm, agent_plane, "index", 6)
    agents = [url(n) for n in nodes]
    assert create_namespace(agents[0], "job", 3).status_code == 201
    shards = {rank: os.urandom(50_000 + rank) for rank in range(3)}
    for rank, data in shards.items():  # each rank through its own node's agent
        assert put(agents[rank], "job", rank, 1, data).status_code == 200
    # The first `latest`s may build a home's view (it asks every agent once).
    for agent in agents:
        assert latest(agent, "job") == [1]
    indexes = total(agents, "hpsim_tier_index_answers_total")
    answers = total(agents, "hpsim_tier_catalog_answers_total")
    for agent in agents:
        assert latest(agent, "job") == [1]
    # Six `latest`s: one home's answer each, and no agent was asked for its index.
    assert total(agents, "hpsim_tier_catalog_answers_total") - answers == len(agents)
    assert total(agents, "hpsim_tier_index_answers_total") == indexes
    assert total(agents, "hpsim_tier_catalog_fallbacks_total") == 0
    # A read through an agent that holds nothing of rank 0 (neither its node nor that node's
    # replica peer, which may have its copy by now): one home says where rank 0 is.
    peers = agent_policy(nodes[0])["replication"]["peers"]
    holders = {nodes[0]["InstanceId"], *(peer["node_id"] for peer in peers)}
    reader = next(a for n, a in zip(nodes, agents, strict=True) if n["InstanceId"] not in holders)
    response = get(reader, "job", 0, 1)
    assert response.status_code == 200
    assert response.content == shards[0]
    assert total(agents, "hpsim_tier_index_answers_total") == indexes
    assert total(agents, "hpsim_tier_catalog_answers_total") - answers == len(agents) + 1


def test_a_new_namespace_saved_by_every_node_is_answered_without_asking_any_agent(
    agent_plane: ControlPlane, sm: Any
) -> None:
    nodes = cluster(sm, agent_plane, "everyone", 4)
    homes = homes_of(nodes, "job")
    # The homes save first: each then knows the member list that the others' reports arrive under.
    order = [*homes, *(n for n in nodes if n not in homes)]
    assert create_namespace(url(order[0]), "job", len(order)).status_code == 201
    for rank, node in enumerate(order):
        assert put(url(node), "job", rank, 1, b"one-%d" % rank).status_code == 200
    agents = [url(n) for n in nodes]
    for agent in agents:
        assert latest(agent, "job") == [1]
    # Every node reported its image as it saved: no home asked anyone for an index to answer.
    assert total(agents, "hpsim_tier_index_answers_total") == 0
    assert total(agents, "hpsim_tier_catalog_rebuilds_total") == 0
    assert total(agents, "hpsim_tier_catalog_fallbacks_total") == 0


def test_the_index_never_lists_an_incomplete_step(agent_plane: ControlPlane, sm: Any) -> None:
    agents = [url(n) for n in cluster(sm, agent_plane, "partial", 4)]
    assert create_namespace(agents[0], "job", 3).status_code == 201
    for rank in range(3):
        assert put(agents[rank], "job", rank, 4, b"four-%d" % rank).status_code == 200
    # Step 5: rank 1 is held nowhere.
    assert put(agents[0], "job", 0, 5, b"five-0").status_code == 200
    assert put(agents[2], "job", 2, 5, b"five-2").status_code == 200
    for agent in agents:
        assert latest(agent, "job") == [4]
    assert put(agents[3], "job", 1, 5, b"five-1").status_code == 200
    for agent in agents:
        assert latest(agent, "job") == [5, 4]
    # A delete through any agent removes a rank: the step is no longer complete anywhere.
    assert httpx.delete(f"{agents[1]}/v1/cp/checkpoints/job/1/5").status_code == 200
    for agent in agents:
        assert latest(agent, "job") == [4]
    assert total(agents, "hpsim_tier_catalog_fallbacks_total") == 0


@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_a_killed_agents_ranks_are_found_on_its_replica(
    agent_plane: ControlPlane, sm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPSIM_AGENT_REPLICATION", "sync")  # a save is answered once replicated
    nodes = cluster(sm, agent_plane, "replicated", 5, recovery="None")
    agents = [url(n) for n in nodes]
    assert create_namespace(agents[0], "job", 2).status_code == 201
    # Both ranks on a node that is no home of the namespace, so killing it leaves both homes.
    owner = next(n for n in nodes if n not in homes_of(nodes, "job"))
    data = {rank: os.urandom(80_000) for rank in range(2)}
    for rank, blob in data.items():
        assert put(url(owner), "job", rank, 3, blob).status_code == 200
    others = [a for a in agents if a != url(owner)]
    assert latest(others[0], "job") == [3]
    remote_reads = total(others, "hpsim_tier_remote_reads_total")
    for pid in find_agent_pids(owner["InstanceId"]):
        os.kill(pid, signal.SIGKILL)
    for agent in others:
        assert latest(agent, "job") == [3]
    # Read through an agent that holds neither copy: the index names the owner (dead: refused at
    # once) and its replica, which serves.
    replica_node = next(
        n
        for n in nodes
        if n["InstanceId"] != owner["InstanceId"] and metric(url(n), "hpsim_tier_shards") >= 2
    )
    reader = next(a for a in others if a != url(replica_node))
    for rank, blob in data.items():
        response = get(reader, "job", rank, 3)
        assert response.status_code == 200
        assert response.content == blob
        assert response.headers["X-Hpsim-Tier"] == "replica"
    assert total(others, "hpsim_tier_remote_reads_total") - remote_reads == len(data)


@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_a_home_killed_and_restarted_rebuilds_its_view(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    nodes = cluster(sm, agent_plane, "rehome", 4, recovery="None")
    agents = [url(n) for n in nodes]
    assert create_namespace(agents[0], "job", 4).status_code == 201
    for rank in range(4):
        assert put(agents[rank], "job", rank, 2, b"two-%d" % rank).status_code == 200
        assert put(agents[rank], "job", rank, 3, b"three-%d" % rank).status_code == 200
    first = homes_of(nodes, "job")[0]
    caller = next(a for n, a in zip(nodes, agents, strict=True) if n is not first)
    before = latest(caller, "job")
    assert before == [3, 2]
    # The first home's agent crashes and comes back on the same node, same shared memory, as the
    # provisioner starts one: with a new launch secret (the old one is spent).
    (pid,) = find_agent_pids(first["InstanceId"])
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not find_agent_pids(first["InstanceId"]), timeout=30, what="the agent to die")
    # Meanwhile the second home answers, and saves go on (their reports to the dead home fail).
    assert latest(caller, "job") == before
    for rank in range(4):
        assert put(caller, "job", rank, 4, b"four-%d" % rank).status_code == 200
    before = latest(caller, "job")
    assert before == [4, 3, 2]
    environ[b"HPSIM_AGENT_TOKEN"] = launch_secret(agent_plane, first["InstanceId"]).encode()
    with open(tmp_path / "restarted.log", "wb") as log:
        restarted = subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)
    try:

        def restarted_endpoint() -> str | None:
            node = next(n for n in members(agent_plane, "rehome") if n["InstanceId"] == first["InstanceId"])
            try:
                adopted = metric(url(node), "hpsim_tier_shards") >= 2  # its rank of steps 2 and 3
            except httpx.HTTPError:
                return None
            return url(node) if adopted else None

        wait_for(lambda: restarted_endpoint() is not None, timeout=60, what="the restarted home")
        home = restarted_endpoint()
        assert home is not None
        assert metric(home, "hpsim_tier_catalog_rebuilds_total") == 0
        assert latest(caller, "job") == before
        # The restarted first home answered, from a view it built again by asking every agent once.
        assert metric(home, "hpsim_tier_catalog_rebuilds_total") == 1
        assert metric(home, "hpsim_tier_catalog_answers_total") == 1
        assert latest(caller, "job") == before
        assert metric(home, "hpsim_tier_catalog_rebuilds_total") == 1
        assert metric(home, "hpsim_tier_catalog_answers_total") == 2
    finally:
        restarted.kill()
        restarted.wait(timeout=30)


def test_the_checkpoint_listing_asks_one_home_per_namespace(agent_plane: ControlPlane, sm: Any) -> None:
    nodes = cluster(sm, agent_plane, "listed", 5)
    agents = [url(n) for n in nodes]
    for name in ("alpha", "beta"):
        assert create_namespace(agents[0], name, 2).status_code == 201
        for rank in range(2):
            assert put(agents[rank + 2], name, rank, 1, b"%s-%d" % (name.encode(), rank)).status_code == 200
    with HyperPodClient(agent_plane.url) as client:
        first = client.checkpoints("listed")  # a home may build its view (asks every agent once)
        indexes = total(agents, "hpsim_tier_index_answers_total")
        answers = total(agents, "hpsim_tier_catalog_answers_total")
        listing = client.checkpoints("listed")
    assert listing == first
    assert listing["Unreachable"] == []
    memory = {ns["Namespace"]: ns["Steps"][0]["Memory"] for ns in listing["Namespaces"]}
    holders = {"0": nodes[2]["InstanceId"], "1": nodes[3]["InstanceId"]}
    assert memory == {"alpha": holders, "beta": holders}
    # One home's answer per namespace, and no agent was asked for its own index.
    assert total(agents, "hpsim_tier_catalog_answers_total") - answers == 2
    assert total(agents, "hpsim_tier_index_answers_total") == indexes
