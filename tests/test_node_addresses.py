"""An address per node, for its whole life (README, "Nodes and their agents"): on the loopback
network every node has one of 127.77.0.0/16 and its agent listens at port 9200 of it, as HyperPod's
daemon does; an agent restart, a reboot and a restart of ``serve`` keep it, a replacement is a new
node with a new address. DescribeClusterNode and ListClusterNodes show it as AWS does.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from hyperpod_sim.domain.nodes.agent_inputs import endpoint_address
from hyperpod_sim.infra.addresses import AGENT_PORT, LOOPBACK_BLOCK, LoopbackAddresses, can_bind
from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.client import HyperPodClient
from hyperpod_sim.settings import Settings
from tests.conftest import EKS, ControlPlane, ServerProcess, group, kill_processes_under, wait_for
from tests.faults import descriptions

# ---------------------------------------------------------------------- drawing an address


def test_a_draw_passes_over_taken_and_bound_addresses() -> None:
    # A block of its own (outside 127.77/16, which other control planes of this machine draw
    # from): .0 is never drawn, .1 is a node's, .2's port is bound; only .3 is free.
    block = ipaddress.IPv4Network(f"127.79.{time.monotonic_ns() % 250}.0/30")
    hosts = [str(block.network_address + i) for i in range(4)]
    addresses = LoopbackAddresses(block=block, attempts=200)
    with socket.socket() as busy:
        busy.bind((hosts[2], AGENT_PORT))
        busy.listen()
        assert not can_bind(hosts[2], AGENT_PORT)
        assert addresses.draw(lambda address: address == hosts[1]) == hosts[3]
        assert LoopbackAddresses(block=block, attempts=20).draw(lambda a: a in (hosts[1], hosts[3])) is None


def test_the_block_keeps_clear_of_127_0_0_x() -> None:
    assert str(LOOPBACK_BLOCK) == "127.77.0.0/16"
    assert not LOOPBACK_BLOCK.overlaps(ipaddress.IPv4Network("127.0.0.0/23"))


def test_an_external_agents_address_is_the_host_it_registers_from() -> None:
    assert endpoint_address("http://10.1.2.3:9200") == "10.1.2.3"
    assert endpoint_address("http://agent-0.agents.default.svc:9200") is None
    assert endpoint_address("http://[fd00::1]:9200") is None


def test_the_node_network_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().provisioning.node_network == "loopback"
    monkeypatch.setenv("HPSIM_PROVISIONING__NODE_NETWORK", "shared")
    assert Settings().provisioning.node_network == "shared"
    monkeypatch.setenv("HPSIM_PROVISIONING__NODE_NETWORK", "bridge")
    with pytest.raises(ValidationError, match="'loopback', 'shared' or 'namespaces'"):
        Settings()


# ---------------------------------------------------------------------- simulated nodes


def ips(sm: Any, name: str) -> dict[str, str]:
    nodes = sm.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"]
    return {
        n["InstanceId"]: sm.describe_cluster_node(ClusterName=name, NodeId=n["InstanceId"])["NodeDetails"][
            "PrivatePrimaryIp"
        ]
        for n in nodes
    }


def test_simulated_nodes_get_addresses_too(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="sim", InstanceGroups=[group("workers", 3)], Orchestrator=EKS)
    control_plane.settle(sm, "sim")
    found = ips(sm, "sim")
    assert len(set(found.values())) == 3
    assert all(ipaddress.IPv4Address(ip) in LOOPBACK_BLOCK for ip in found.values()), found


SIMULATED_SHARED = {"mode": "simulated", "node_ready_delay_s": 60, "node_network": "shared"}


@pytest.mark.parametrize("settings_overrides", [{"provisioning": SIMULATED_SHARED}])
def test_on_the_shared_network_nodes_keep_their_private_ips(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="shared", InstanceGroups=[group("workers", 2)], Orchestrator=EKS)
    control_plane.settle(sm, "shared")
    assert all(ip.startswith("10.") for ip in ips(sm, "shared").values())


# ---------------------------------------------------------------------- real agents


def nodes_of(client: HyperPodClient, name: str) -> dict[str, dict[str, Any]]:
    """The cluster's nodes by id, as DescribeClusterNode answers (REST)."""
    return {n["InstanceId"]: client.describe_node(name, n["InstanceId"]) for n in client.list_nodes(name)}


def answers(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def started_again(client: HyperPodClient, name: str, node_id: str, old_pid: int) -> dict[str, Any] | None:
    """The node once it is Running with an agent other than ``old_pid`` that answers."""
    pids = find_agent_pids(node_id)
    node = client.describe_node(name, node_id)
    endpoint = (node.get("AgentStatus") or {}).get("Endpoint")
    if not pids or old_pid in pids or node["InstanceStatus"]["Status"] != "Running" or not endpoint:
        return None
    return node if answers(endpoint) else None


def test_each_node_has_an_address_for_life(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    sm.create_cluster(ClusterName="addr", InstanceGroups=[group("workers", 3)], Orchestrator=EKS)
    with HyperPodClient(agent_plane.url) as client:
        client.wait_until_in_service("addr", timeout=90)
        before = nodes_of(client, "addr")
        addresses = {n: d["PrivatePrimaryIp"] for n, d in before.items()}
        assert len(set(addresses.values())) == 3, addresses
        summaries = {
            s["InstanceId"]: s for s in sm.list_cluster_nodes(ClusterName="addr")["ClusterNodeSummaries"]
        }
        for node_id, details in before.items():
            address = details["PrivatePrimaryIp"]
            assert ipaddress.IPv4Address(address) in LOOPBACK_BLOCK
            # EC2's private DNS name; us-east-1's domain is ec2.internal.
            hostname = f"ip-{address.replace('.', '-')}.ec2.internal"
            assert details["PrivateDnsHostname"] == summaries[node_id]["PrivateDnsHostname"] == hostname
            endpoint = details["AgentStatus"]["Endpoint"]
            assert endpoint == f"http://{address}:9200"
            assert answers(endpoint)  # Running: it answers at its endpoint
        boto = sm.describe_cluster_node(ClusterName="addr", NodeId=next(iter(before)))["NodeDetails"]
        assert boto["PrivatePrimaryIp"] == addresses[boto["InstanceId"]]

        crashed, rebooted, replaced = sorted(before)
        # An agent crash: the agent starts again on its node, at the same address and port.
        (old_pid,) = find_agent_pids(crashed)
        client.inject_fault("addr", Type="AgentCrash", InstanceId=crashed)
        after = wait_for(lambda: started_again(client, "addr", crashed, old_pid), timeout=60, what="restart")
        assert after["PrivatePrimaryIp"] == addresses[crashed]
        assert after["AgentStatus"]["Endpoint"] == before[crashed]["AgentStatus"]["Endpoint"]
        endpoint = after["AgentStatus"]["Endpoint"]
        # The new agent answers before it registers: the event follows its registration.
        wait_for(
            lambda: f"Agent re-registered at {endpoint}." in descriptions(client, "addr"),  # the same node
            timeout=60,
            what="the re-registration",
            explain=lambda: descriptions(client, "addr"),
        )

        # A reboot: the same node, the same address.
        (old_pid,) = find_agent_pids(rebooted)
        answer = sm.batch_reboot_cluster_nodes(ClusterName="addr", NodeIds=[rebooted])
        assert answer["Successful"] == [rebooted]
        after = wait_for(lambda: started_again(client, "addr", rebooted, old_pid), timeout=60, what="reboot")
        assert after["PrivatePrimaryIp"] == addresses[rebooted]
        assert after["AgentStatus"]["Endpoint"] == before[rebooted]["AgentStatus"]["Endpoint"]

        # A replacement is a new node: a new address.
        answer = sm.batch_replace_cluster_nodes(ClusterName="addr", NodeIds=[replaced])
        assert answer["Successful"] == [replaced]

        def new_node() -> dict[str, Any] | None:
            listed = {n["InstanceId"] for n in client.list_nodes("addr")}
            fresh = listed - set(before)
            if replaced in listed or len(fresh) != 1:
                return None
            details = client.describe_node("addr", fresh.pop())
            endpoint = (details.get("AgentStatus") or {}).get("Endpoint")
            running = details["InstanceStatus"]["Status"] == "Running"
            return details if running and endpoint and answers(endpoint) else None

        fresh = wait_for(new_node, timeout=90, what="the replacement")
        assert fresh["PrivatePrimaryIp"] not in addresses.values()
        assert ipaddress.IPv4Address(fresh["PrivatePrimaryIp"]) in LOOPBACK_BLOCK
        assert fresh["AgentStatus"]["Endpoint"] == f"http://{fresh['PrivatePrimaryIp']}:9200"
        kept = {n: d["PrivatePrimaryIp"] for n, d in nodes_of(client, "addr").items() if n in before}
        assert kept == {n: a for n, a in addresses.items() if n != replaced}


# ---------------------------------------------------------------------- a restart of serve


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_processes_under(tmp_path)


SERVE_ENV = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
    "HPSIM_RECONCILER__INTERVAL_S": "0.2",
    "HPSIM_AGENT_REGISTER_BACKOFF_MAX_S": "0.5",
    "HPSIM_S3__EMBEDDED": "off",  # these agents need no S3
}


def stop(server: ServerProcess, mode: str) -> None:
    """Stop ``serve`` as ``mode`` names (as tests/test_restart.py does): Ctrl+C to its process
    group, SIGTERM to its pid, or SIGKILL."""
    assert server.process is not None
    if mode == "ctrl-c":
        os.killpg(server.process.pid, signal.SIGINT)
    elif mode == "sigterm":
        server.process.send_signal(signal.SIGTERM)
    else:
        server.process.kill()
    server.process.wait(timeout=90)


def endpoints(server: ServerProcess, name: str) -> dict[str, tuple[str, str]]:
    with HyperPodClient(server.url) as client:
        return {
            n: (d["PrivatePrimaryIp"], d["AgentStatus"]["Endpoint"])
            for n, d in nodes_of(client, name).items()
        }


def running_and_heard(server: ServerProcess, name: str, since: float) -> bool:
    with HyperPodClient(server.url) as client:
        listed = client.list_nodes(name)
    return len(listed) == 2 and all(
        n["InstanceStatus"]["Status"] == "Running"
        and float((n.get("AgentStatus") or {}).get("LastHeartbeatTime") or 0) > since
        for n in listed
    )


@pytest.mark.parametrize("mode", ["ctrl-c", "sigterm", "sigkill"])
def test_a_restart_of_serve_keeps_every_endpoint(mode: str, database_url: str, data_dir: Path) -> None:
    first = ServerProcess(database_url, data_dir, SERVE_ENV).start()
    try:
        first.client().create_cluster(
            ClusterName="keep", InstanceGroups=[group("workers", 2)], Orchestrator=EKS
        )
        with HyperPodClient(first.url) as client:
            client.wait_until_in_service("keep", timeout=90)
        before = endpoints(first, "keep")
        assert all(endpoint == f"http://{ip}:9200" for ip, endpoint in before.values()), before
        stop(first, mode)
    finally:
        first.kill()

    second = ServerProcess(database_url, data_dir, SERVE_ENV, port=first.port).start()
    try:
        up = time.time()
        wait_for(lambda: running_and_heard(second, "keep", up), timeout=60, what="the agents back")
        assert endpoints(second, "keep") == before
        assert all(answers(endpoint) for _, endpoint in before.values())
    finally:
        second.stop()


# ---------------------------------------------------------------------- external agents


@pytest.mark.parametrize("settings_overrides", [{"provisioning": {"mode": "external"}}])
def test_an_external_node_has_the_address_its_agent_registers_from(control_plane: ControlPlane) -> None:
    sm = control_plane.client()
    sm.create_cluster(ClusterName="ext", InstanceGroups=[group("workers", 2)], Orchestrator=EKS)
    bootstrap = httpx.get(f"{control_plane.url}/clusters/ext/agent-bootstrap").json()["BootstrapToken"]
    agents = control_plane.services.agents
    by_ip = agents.register(
        cluster_name="ext", token=bootstrap, node_id=None, endpoint="http://10.1.2.3:9200", pid=None
    )["node_id"]
    by_name = agents.register(
        cluster_name="ext", token=bootstrap, node_id=None, endpoint="http://agent-1.agents:9200", pid=None
    )["node_id"]
    details = sm.describe_cluster_node(ClusterName="ext", NodeId=by_ip)["NodeDetails"]
    assert (details["PrivatePrimaryIp"], details["PrivateDnsHostname"]) == (
        "10.1.2.3",
        "ip-10-1-2-3.ec2.internal",
    )
    # A host name is no address: the node shows the private IP it was given at launch.
    named = sm.describe_cluster_node(ClusterName="ext", NodeId=by_name)["NodeDetails"]["PrivatePrimaryIp"]
    assert named.startswith("10.")
    assert named != "10.1.2.3"
