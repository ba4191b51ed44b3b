"""``hyperpod-sim job run`` on the namespaces node network (issue 26): every rank runs inside its
node's network namespace, as ``node exec`` does, so MASTER_ADDR is the first node's subnet address
and gloo's traffic goes between the nodes' namespaces over the bridge. As root only.

Each test has a subnet of its own (``node_network``, tests/plugins/namespaces.py); nothing of it
(namespace, veth, bridge, route) is left afterwards, also when the test failed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from pathlib import Path

import pytest

from hyperpod_sim.cli.common import CommandError, on_node
from hyperpod_sim.infra import netns
from hyperpod_sim.infra.netns_exec import trampoline_argv
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import ServerProcess, shm_root_for, wait_for
from tests.job_runs import WORKER, lose_a_node_mid_run, rank_lines, run_job
from tests.node_namespaces import needs_root, processes_under, serve_on
from tests.tier import cluster


def _namespace_of(node_id: str) -> str:
    """The node's network namespace as /proc/<pid>/ns/net names it: ``net:[inode]``."""
    return f"net:[{os.stat(Path('/run/netns') / netns.namespace_name(node_id)).st_ino}]"


@needs_root
def test_a_two_node_job_computes_across_the_nodes_namespaces(
    ns_plane: ServerProcess, node_network: netns.NodeNetwork, tmp_path: Path, no_job_left: None
) -> None:
    nodes = cluster(ns_plane.client(), ns_plane, "train", 2)
    done = run_job(
        ns_plane,
        tmp_path,
        "--cluster",
        "train",
        "--nodes",
        "2",
        "--procs-per-node",
        "2",
        "--name",
        "sum",
        command=[*WORKER, "allreduce"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reports = {rank: json.loads(lines[-1]) for rank, lines in rank_lines(done.stdout).items()}
    assert sorted(reports) == [0, 1, 2, 3]
    assert {r["sum"] for r in reports.values()} == {10.0}  # 1 + 2 + 3 + 4, over both nodes
    with HyperPodClient(ns_plane.url) as client:
        address = {
            n["InstanceId"]: client.describe_node("train", n["InstanceId"])["PrivatePrimaryIp"] for n in nodes
        }
        job = client.describe_job("train", "sum")
    assert job["Status"] == "Succeeded"
    first = reports[0]["node"]
    assert {r["node"] for r in reports.values()} == set(address)  # both nodes took part
    assert {r["master"] for r in reports.values()} == {address[first]}
    assert ipaddress.IPv4Address(address[first]) in node_network.subnet
    host = os.readlink("/proc/self/ns/net")
    for rank, report in reports.items():
        node = report["node"]
        assert report["group_rank"] == rank // 2
        # Inside its node: the node's namespace, not the host's, and the node's own address.
        assert report["netns"] == _namespace_of(node) != host, report
        assert report["source"] == address[node], report
    assert reports[0]["netns"] != reports[2]["netns"]  # the two nodes are two namespaces


@needs_root
def test_a_lost_node_restarts_the_job_inside_its_replacement(
    node_network: netns.NodeNetwork, tmp_path: Path, no_job_left: None
) -> None:
    # The lost node is failed, and replaced, after 6 s of its agent's silence (at 3 s, the other
    # node too was failed once in a while on a loaded CI machine, and the job restarted twice).
    env = {"HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.5"}
    server = serve_on(tmp_path, node_network, heartbeat_timeout_s=6.0)
    server.env.update(env)
    server.start()
    try:
        _resumes(server, tmp_path)
        server.stop()
        wait_for(lambda: not processes_under(tmp_path), timeout=30, what="the agents to stop with serve")
    finally:
        server.stop()
        shutil.rmtree(shm_root_for(tmp_path), ignore_errors=True)


def _resumes(ns_plane: ServerProcess, tmp_path: Path) -> None:
    nodes = cluster(ns_plane.client(), ns_plane, "resume", 2)
    stdout, victim, progress = lose_a_node_mid_run(ns_plane.url, tmp_path, steps=4, pause_at=2, timeout=240)
    with HyperPodClient(ns_plane.url) as client:
        job = client.describe_job("resume", "llm")
        replacement = job["Attempts"][1]["Nodes"][1]
        replaced = client.describe_node("resume", replacement)["PrivatePrimaryIp"]
        inside = _namespace_of(replacement)
    assert job["Status"] == "Succeeded"
    first, second = job["Attempts"]
    assert (first["Cause"], first["CauseNodeId"]) == ("NodeFailure", victim)
    assert second["Nodes"][0] == first["Nodes"][0]
    assert replacement not in {n["InstanceId"] for n in nodes}  # the victim's replacement, a new node
    assert netns.node_address(replacement) == replaced  # inside its own namespace
    assert progress.read_text().split("\n")[:-1] == ["1 1", "1 2", "2 3", "2 4"]
    ranks = rank_lines(stdout)
    assert "attempt 2 resumes after step 2" in "\n".join(ranks[0])
    # Rank 1 of the second attempt ran inside the replacement's namespace.
    assert f"attempt 2 resumes after step 2 (network namespace {inside})" in ranks[1], ranks[1]


@pytest.mark.parametrize("euid", [0, 1000])
def test_ranks_and_node_exec_enter_a_node_through_the_trampoline_as_root_only(
    monkeypatch: pytest.MonkeyPatch, euid: int
) -> None:
    argv = ["python", "train.py"]
    assert on_node(argv, {"HPSIM_NODE_ID": "i-1"}, "i-1", command="job run") == argv  # no namespace
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    environment = {"HPSIM_NODE_ID": "i-1", "HPSIM_NODE_NETNS": "hpsim-i-1"}
    if euid == 0:  # the command line netns_exec documents, which the cluster commands may not import
        assert on_node(argv, environment, "i-1", command="job run") == trampoline_argv("hpsim-i-1", argv)
        return
    with pytest.raises(CommandError) as refused:
        on_node(argv, environment, "i-1", command="job run")
    assert refused.value.code == "AccessDeniedException"
    assert refused.value.message == (
        "node i-1 is the network namespace hpsim-i-1: entering it takes root (CAP_SYS_ADMIN); "
        "run job run as root"
    )
