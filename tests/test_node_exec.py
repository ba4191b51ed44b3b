"""``hyperpod-sim node exec``: a command runs on a node with its environment and exit status, and
it ends when its node is lost or deleted, as a machine's processes do (issue 25)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.contracts.processes import start_time
from hyperpod_sim.infra.node_processes import ON_NODE, end_node_processes, node_processes
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import ControlPlane, wait_for
from tests.faults import descriptions
from tests.helpers import ROOT, hpsim
from tests.tier import cluster

# Prints its environment's HPSIM_* as JSON, whether its agent answers, and exits 3.
REPORT = textwrap.dedent(
    """
    import json, os, sys, urllib.request
    env = {k: v for k, v in os.environ.items() if k.startswith("HPSIM_")}
    with urllib.request.urlopen(env["HPSIM_AGENT_URL"] + "/health", timeout=10) as answer:
        env["agent answers"] = str(answer.status)
    print(json.dumps(env))
    sys.exit(3)
    """
)


def node_exec_argv(endpoint: str, cluster_name: str, node_id: str, *command: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hyperpod_sim",
        "node",
        "exec",
        "--endpoint-url",
        endpoint,
        "--cluster",
        cluster_name,
        node_id,
        "--",
        *command,
    ]


def run_on(endpoint: str, cluster_name: str, node_id: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        node_exec_argv(endpoint, cluster_name, node_id, *command),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_a_command_runs_in_its_nodes_environment_with_its_exit_status(agent_plane: ControlPlane) -> None:
    nodes = cluster(agent_plane.client(), agent_plane, "exec", 2)
    first = nodes[0]
    done = run_on(agent_plane.url, "exec", first["InstanceId"], sys.executable, "-c", REPORT)
    assert done.returncode == 3, done.stderr
    env = json.loads(done.stdout)
    assert env["HPSIM_NODE_ID"] == env[ON_NODE] == first["InstanceId"]
    assert env["HPSIM_CLUSTER"] == "exec"
    assert env["HPSIM_AGENT_URL"] == first["AgentStatus"]["Endpoint"]
    with HyperPodClient(agent_plane.url) as client:
        described = client.describe_node("exec", first["InstanceId"])
    assert env["HPSIM_NODE_ADDRESS"] == described["PrivatePrimaryIp"]
    assert env["HPSIM_ENDPOINT_URL"] == agent_plane.url
    assert env["agent answers"] == "200"
    # Standard input reaches the command; a signal's end reads as a shell reports it.
    echoed = subprocess.run(
        node_exec_argv(agent_plane.url, "exec", nodes[1]["InstanceId"], "cat"),
        input="to the node\n",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert (echoed.returncode, echoed.stdout) == (0, "to the node\n"), echoed.stderr
    killed = run_on(agent_plane.url, "exec", first["InstanceId"], "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 128 + signal.SIGTERM


def test_refusals_name_what_is_wrong(agent_plane: ControlPlane) -> None:
    (node,) = cluster(agent_plane.client(), agent_plane, "refuse", 1)
    missing = run_on(agent_plane.url, "refuse", "i-0123456789abcdef0", "true")
    assert missing.returncode == 1
    assert "ResourceNotFound" in missing.stderr
    assert "i-0123456789abcdef0" in missing.stderr
    no_cluster = run_on(agent_plane.url, "nope", node["InstanceId"], "true")
    assert no_cluster.returncode == 1
    assert "ResourceNotFound" in no_cluster.stderr
    bad_id = run_on(agent_plane.url, "refuse", "node-1", "true")
    assert bad_id.returncode == 1
    assert "ValidationException" in bad_id.stderr
    nothing = hpsim(
        None,
        "node",
        "exec",
        "--cluster",
        "refuse",
        node["InstanceId"],
        env={"HPSIM_ENDPOINT_URL": agent_plane.url},
    )
    assert nothing.returncode == 1
    assert "no command to run" in nothing.stderr
    absent = run_on(agent_plane.url, "refuse", node["InstanceId"], "/no/such/program")
    assert absent.returncode == 127
    assert "cannot run '/no/such/program'" in absent.stderr


def test_simulated_nodes_run_no_commands(control_plane: ControlPlane) -> None:
    with HyperPodClient(control_plane.url) as client, pytest.raises(ClusterError) as refused:
        client.start_node_session("any", "i-0123456789abcdef0")
    assert refused.value.code == "ValidationException"
    assert "local provisioner" in str(refused.value)


def sleeper(tmp_path: Path, name: str) -> list[str]:
    """A command that starts a child of its own, writes both pids to ``name`` and sleeps."""
    pids = tmp_path / name
    script = f"sleep 600 & echo $$ $! > {pids}.partial && mv {pids}.partial {pids}; wait"
    return ["sh", "-c", script]


def started(tmp_path: Path, name: str) -> list[int] | None:
    path = tmp_path / name
    return [int(p) for p in path.read_text().split()] if path.exists() else None


@pytest.mark.parametrize("end", ["NodeLoss", "DeleteCluster"])
def test_losing_the_node_ends_what_runs_on_it(agent_plane: ControlPlane, tmp_path: Path, end: str) -> None:
    sm = agent_plane.client()
    nodes = cluster(sm, agent_plane, "lose", 2)
    victim, other = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    on_victim = subprocess.Popen(
        node_exec_argv(agent_plane.url, "lose", victim, *sleeper(tmp_path, "victim")),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    on_other = subprocess.Popen(
        node_exec_argv(agent_plane.url, "lose", other, *sleeper(tmp_path, "other")),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    # A process of this user that names the node but is not on it: it stays.
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", victim], env={**os.environ, ON_NODE: ""}
    )
    try:
        victims = wait_for(lambda: started(tmp_path, "victim"), timeout=60, what="the command on the victim")
        others = wait_for(lambda: started(tmp_path, "other"), timeout=60, what="the command on the other")
        assert set(victims) <= set(node_processes([victim]))
        with HyperPodClient(agent_plane.url) as client:
            if end == "NodeLoss":
                client.inject_fault("lose", Type="NodeLoss", InstanceId=victim)
            else:
                sm.delete_cluster(ClusterName="lose")
            assert on_victim.wait(timeout=60) == 128 + signal.SIGKILL
            assert "was killed (SIGKILL)" in (on_victim.stderr.read() if on_victim.stderr else "")
            wait_for(
                lambda: all(start_time(p) is None for p in victims), timeout=30, what="its child gone too"
            )
            if end == "NodeLoss":
                assert on_other.poll() is None  # the other node's command runs on
                assert all(start_time(p) is not None for p in others)
                assert any("NodeLoss" in t and victim in t for t in descriptions(client, "lose"))
            else:
                assert on_other.wait(timeout=60) == 128 + signal.SIGKILL
        assert bystander.poll() is None
    finally:
        for process in (on_victim, on_other, bystander):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        end_node_processes([victim, other])


def test_a_session_needs_a_running_node(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    (node,) = cluster(sm, agent_plane, "stopping", 1)
    sm.batch_delete_cluster_nodes(ClusterName="stopping", NodeIds=[node["InstanceId"]])

    def refused() -> Any:
        try:
            with HyperPodClient(agent_plane.url) as client:
                client.start_node_session("stopping", node["InstanceId"])
        except ClusterError as exc:
            return exc
        return None

    error = wait_for(refused, timeout=60, what="the session refused")
    assert error.code in ("ConflictException", "ResourceNotFound"), error
    if error.code == "ConflictException":
        assert "commands run on a Running node" in str(error)
    answer = httpx.post(
        f"{agent_plane.url}/clusters/stopping/nodes/{node['InstanceId']}/sessions", content=b"["
    )
    assert answer.status_code in (400, 404, 409)
    assert "__type" in answer.json()
