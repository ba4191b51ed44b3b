"""The distributed path as a DaemonSet runs it (issue 25): ``serve`` in ``external`` provisioning
mode with auth on, and agents started elsewhere, each in a network namespace of its own with a
non-loopback address, at port 9200, registering with the cluster's bootstrap token, and a trainer
on those nodes that saves and loads through them. As root only (CI runs as root); the warning
about the embedded S3, which such agents cannot reach, everywhere.

The test builds what Kubernetes would: a bridge (the pod network) and a namespace per node (a pod)
with infra/netns.py; ``serve`` listens on the bridge's gateway address (``--host``), the agents are
started with the command ``GET /clusters/{name}/agent-bootstrap`` gives, as the DaemonSet's
container does (``--host 0.0.0.0 --port 9200 --advertise-host <pod address>``). Its finalizer
removes every namespace, veth, bridge, route and process of it, also when the test failed, and
then asserts that nothing is left.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from hyperpod_sim.infra import netns
from hyperpod_sim.infra.netns_exec import trampoline_argv
from hyperpod_sim.sdk.auth import bearer_token
from tests.conftest import EKS, ROLE, ServerProcess, free_port, kill_processes_under, shm_root_for, wait_for
from tests.helpers import ROOT

_MISSING = netns.missing_privileges() if os.geteuid() == 0 else ["root"]
needs_root = pytest.mark.skipif(
    bool(_MISSING), reason=f"agents in network namespaces need {', '.join(_MISSING)} (CI runs as root)"
)

KEY, SECRET = "AKIDEXTERNALAGENTS", secrets.token_urlsafe(24)
ADMIN_KEY, ADMIN_SECRET = "AKIDEXTERNALADMIN", secrets.token_urlsafe(24)
AGENT_PORT = 9200  # HyperPod's daemon port, as deploy/agents.yaml and docker-compose.yml use it


def _free_subnet() -> netns.NodeNetwork:
    """A /24 of 198.19.0.0/16 that no bridge (another test's, another worker's) holds."""
    for _ in range(64):
        network = netns.NodeNetwork.of(f"198.19.{1 + secrets.randbelow(254)}.0/24")
        if not netns.bridge_exists(network) and not netns.network_namespaces(network):
            return network
    raise AssertionError("no free /24 of 198.19.0.0/16 for this test")


class Pods:
    """The 'pods' of the test: a namespace per node on the test's bridge, each with an address."""

    def __init__(self, network: netns.NodeNetwork, count: int) -> None:
        self.network = network
        self.names = [f"pod-{secrets.token_hex(6)}" for _ in range(count)]
        self.addresses = [str(network.subnet.network_address + 10 + i) for i in range(count)]

    def build(self) -> None:
        netns.ensure_bridge(self.network)
        for name, address in zip(self.names, self.addresses, strict=True):
            netns.ensure_node(self.network, name, address)

    def namespace(self, index: int) -> str:
        return netns.namespace_name(self.names[index])


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    """Two pods on a bridge of this test's own; afterwards nothing of it is left (asserted)."""
    made = Pods(_free_subnet(), 2)
    try:
        made.build()
        yield made
    finally:
        kill_processes_under(tmp_path)  # agents and trainers a failed test left running
        netns.remove_network(made.network, node_ids=made.names)
        left = netns.leftovers(node_ids=made.names, network=made.network)
        left += netns.network_namespaces(made.network)
        assert left == [], f"left behind: {left}"


def _signed_sagemaker(url: str) -> Any:
    return boto3.client(
        "sagemaker",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        config=Config(retries={"max_attempts": 1}),
    )


def _rest(url: str, path: str) -> httpx.Response:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {bearer_token(KEY, SECRET)}"}, timeout=10)


def _agent_argv(command: str, pods: Pods, index: int, data_dir: Path) -> list[str]:
    """The bootstrap route's command as the DaemonSet's container runs it, in pod ``index``: its
    token moved to the environment by the caller, ``hyperpod-sim`` as this interpreter's module."""
    words = shlex.split(command)
    assert words[0].startswith("HPSIM_AGENT_TOKEN="), command
    assert words[1:3] == ["hyperpod-sim", "agent"], command
    argv = [sys.executable, "-m", "hyperpod_sim", *words[2:]]
    argv += ["--host", "0.0.0.0", "--port", str(AGENT_PORT), "--advertise-host", pods.addresses[index]]
    argv += ["--data-dir", str(data_dir), "--shm-dir", str(data_dir / "shm")]
    return trampoline_argv(pods.namespace(index), argv)


def _run_trainer(tmp_path: Path, pods: Pods, urls: list[str], *args: str, label: str) -> list[dict[str, Any]]:
    """A two-rank job of tests/sdk_worker.py, rank r inside pod r talking to its own node's agent
    over HTTP, gloo between the pods (rank 0's address): what a trainer pod per node does."""
    port = free_port()
    processes = []
    outs = [tmp_path / f"{label}-{rank}.json" for rank in range(2)]
    logs = [tmp_path / f"{label}-{rank}.log" for rank in range(2)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": netns.INNER_IFNAME, "PYTHONPATH": str(ROOT)}
    for rank in range(2):
        worker = [
            sys.executable, "-m", "tests.sdk_worker", "--rank", str(rank), "--world-size", "2",
            "--master-addr", pods.addresses[0], "--master-port", str(port), "--agent-url", urls[rank],
            "--namespace", "ext-job", "--out", str(outs[rank]), "--http", *args,
        ]  # fmt: skip
        with open(logs[rank], "wb") as log:
            argv = trampoline_argv(pods.namespace(rank), worker)
            processes.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [process.wait(timeout=180) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    output = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    assert codes == [0, 0], output
    return [json.loads(out.read_text()) for out in outs]


@needs_root
def test_agents_started_as_a_daemonset_serve_a_trainer_across_the_bridge(tmp_path: Path, pods: Pods) -> None:
    gateway = pods.network.gateway
    server = ServerProcess(
        f"sqlite:///{tmp_path / 'cp.db'}",
        tmp_path / "data",
        host=gateway,
        env={
            "HPSIM_PROVISIONING__MODE": "external",
            "HPSIM_AUTH__CREDENTIALS": json.dumps({KEY: SECRET}),
            "HPSIM_AUTH__ADMIN_CREDENTIALS": json.dumps({ADMIN_KEY: ADMIN_SECRET}),
            "HPSIM_S3__EMBEDDED": "off",  # no S3 policy: the in-memory tier only
            "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),
        },
    )
    agents: list[subprocess.Popen[bytes]] = []
    try:
        server.start()
        assert server.url == f"http://{gateway}:{server.port}"
        sm = _signed_sagemaker(server.url)
        sm.create_cluster(
            ClusterName="ext",
            InstanceGroups=[
                {
                    "InstanceGroupName": "workers",
                    "InstanceType": "ml.g5.2xlarge",
                    "InstanceCount": 2,
                    "ExecutionRole": ROLE,
                }
            ],
            Orchestrator=EKS,
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
        )

        # The bootstrap route is behind the control plane's credentials.
        assert httpx.get(f"{server.url}/clusters/ext/agent-bootstrap", timeout=10).status_code in (401, 403)
        bootstrap = _rest(server.url, "/clusters/ext/agent-bootstrap")
        assert bootstrap.status_code == 200, bootstrap.text
        answer = bootstrap.json()
        assert answer["ControlPlaneUrl"] == server.url  # where the pods reach it: the gateway
        assert answer["Command"].startswith(
            f"HPSIM_AGENT_TOKEN={answer['BootstrapToken']} hyperpod-sim agent "
        )

        for index in range(2):
            data_dir = tmp_path / f"agent-{index}"
            data_dir.mkdir()
            env = {**os.environ, "HPSIM_AGENT_TOKEN": answer["BootstrapToken"], "PYTHONPATH": str(ROOT)}
            with open(tmp_path / f"agent-{index}.log", "wb") as log:
                argv = _agent_argv(answer["Command"], pods, index, data_dir)
                agents.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

        def in_service() -> bool:
            for index, agent in enumerate(agents):
                if agent.poll() is not None:
                    log = (tmp_path / f"agent-{index}.log").read_text(errors="replace")
                    raise AssertionError(f"agent {index} exited with {agent.returncode}: {log[-3000:]}")
            return bool(sm.describe_cluster(ClusterName="ext")["ClusterStatus"] == "InService")

        wait_for(in_service, timeout=90, what="the cluster InService with its external agents")

        # Every node shows its pod's address and the agent at :9200 of it.
        summaries = sm.list_cluster_nodes(ClusterName="ext")["ClusterNodeSummaries"]
        nodes = [
            sm.describe_cluster_node(ClusterName="ext", NodeId=s["InstanceId"])["NodeDetails"]
            for s in summaries
        ]
        by_address = {node["PrivatePrimaryIp"]: node for node in nodes}
        assert sorted(by_address) == sorted(pods.addresses)
        for address, node in by_address.items():
            assert node["InstanceStatus"]["Status"] == "Running"
            assert node["PrivateDnsHostname"] == f"ip-{address.replace('.', '-')}.ec2.internal"
        endpoints = {
            n["InstanceId"]: n["AgentStatus"]["Endpoint"]
            for n in _rest(server.url, "/clusters/ext/nodes").json()["ClusterNodeSummaries"]
        }
        urls = [f"http://{address}:{AGENT_PORT}" for address in pods.addresses]
        assert sorted(endpoints.values()) == sorted(urls)

        # A trainer pod per node: save step 1 through the node's agent, then load it back.
        saved = _run_trainer(tmp_path, pods, urls, "--save", "1", label="save")
        assert [r["saved"] for r in saved] == [[1], [1]]
        # Each agent replicated its shards to its peer across the bridge (resolved through the
        # control plane's members), and the control plane reached both for the listing.
        node_of = {node["PrivatePrimaryIp"]: node["InstanceId"] for node in nodes}
        first, second = (node_of[address] for address in pods.addresses)

        def replicated() -> dict[str, Any] | None:
            listing = _rest(server.url, "/clusters/ext/checkpoints").json()
            if listing["Unreachable"]:
                return None
            steps = [s for n in listing["Namespaces"] if n["Namespace"] == "ext-job" for s in n["Steps"]]
            step = steps[0] if steps else None
            if step is None or not {"0", "1"} <= step["Replica"].keys():
                return None
            return dict(step)

        step = wait_for(
            replicated,
            timeout=60,
            what="step 1 replicated between the agents, both reached",
            explain=lambda: _rest(server.url, "/clusters/ext/checkpoints").json(),
        )
        assert step["Step"] == 1
        assert step["Complete"] is True
        assert (step["Memory"]["0"], step["Memory"]["1"]) == (first, second)
        assert (step["Replica"]["0"], step["Replica"]["1"]) == ([second], [first])

        loaded = _run_trainer(tmp_path, pods, urls, "--load", label="load")
        for rank, result in enumerate(loaded):
            assert result["loaded_step"] == 1, result
            assert result["equal"] is True, result  # byte for byte what rank saved
            assert result["rejected"] == {}, result
            assert result["skipped"] == {}, result
            assert set(result["served_by"].values()) == {"memory"}, result  # the agents' memory tier
            assert rank == result["rank"]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=45)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        server.stop()


def _serve_stderr(tmp_path: Path, embedded: str) -> str:
    """What ``serve`` in external mode with ``HPSIM_S3__EMBEDDED=embedded`` wrote to stderr by the
    time it said it serves (it is stopped afterwards)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPSIM_")}
    env |= {
        "HPSIM_PROVISIONING__MODE": "external",
        "HPSIM_S3__EMBEDDED": embedded,
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),
    }
    argv = [sys.executable, "-m", "hyperpod_sim", "serve", "--port", str(free_port())]
    argv += ["--data-dir", str(tmp_path / "d")]
    errors = tmp_path / "stderr"
    with open(errors, "wb") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # blocks until serve prints (or exits)
            if line.startswith("hyperpod-sim control plane on "):
                break
        else:
            raise AssertionError(f"serve exited with {process.wait()}: {errors.read_text()}")
    finally:
        process.terminate()
        process.wait(timeout=60)
    return errors.read_text()


def test_serve_warns_that_external_agents_cannot_reach_the_embedded_s3(tmp_path: Path) -> None:
    # Its policies would name the embedded S3's loopback URL, and only agents serve starts get its
    # credentials: every persist of an agent elsewhere would fail.
    stderr = _serve_stderr(tmp_path, "moto")
    assert "warning: the embedded S3 at http://127.0.0.1:" in stderr
    assert "the external provisioner's agents cannot persist checkpoints to it" in stderr
    assert "Set HPSIM_S3__ENDPOINT_URL" in stderr


def test_serve_without_the_embedded_s3_does_not_warn(tmp_path: Path) -> None:
    assert "embedded S3" not in _serve_stderr(tmp_path, "off")
