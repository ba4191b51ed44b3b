"""The namespaces node network (issue 25): every node a network namespace on a bridge, its agent
inside at <address>:9200, ``node exec`` inside, a NetworkPartition in the kernel. As root only.

Every test runs on a subnet of its own (a /24 of 198.19.0.0/16, its own bridge), and its
finalizer (``node_network``, tests/plugins/namespaces.py) removes every namespace, veth, bridge
and route of it, also when the test failed, and then asserts that nothing is left.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from hyperpod_sim.infra import netns
from hyperpod_sim.infra.netns_exec import trampoline_argv
from hyperpod_sim.sdk.client import HyperPodClient
from hyperpod_sim.settings import Settings
from tests.conftest import EKS, ROLE, ServerProcess, shm_root_for, wait_for
from tests.faults import descriptions
from tests.helpers import ROOT
from tests.node_namespaces import needs_root, serve_on


def _cluster(server: ServerProcess, name: str, count: int) -> list[dict[str, Any]]:
    """A tiered cluster InService; its nodes' summaries."""
    sm = server.client()
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "w",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": count,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=90,
        what=f"{name} InService",
    )
    with HyperPodClient(server.url) as client:
        return client.list_nodes(name)


def _node_exec(server: ServerProcess, name: str, node_id: str, code: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "hyperpod_sim", "node", "exec", "--endpoint-url", server.url]
    argv += ["--cluster", name, node_id, "--", sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def _run_example(
    server: ServerProcess, name: str, node_id: str, namespace: str, steps: int = 2, first: int = 1
) -> Any:
    """examples/checkpoint_default_config.py on the node with node exec: what it printed."""
    argv = [sys.executable, "-m", "hyperpod_sim", "node", "exec", "--endpoint-url", server.url]
    argv += ["--cluster", name, node_id, "--", sys.executable, "examples/checkpoint_default_config.py"]
    argv += ["--namespace", namespace, "--steps", str(steps), "--first-step", str(first)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# Connects to the control plane as the node reaches it: "reached" or the error.
PROBE = """
import os, socket, urllib.parse
url = urllib.parse.urlsplit(os.environ["HPSIM_ENDPOINT_URL"])
try:
    socket.create_connection((url.hostname, url.port), timeout=2).close()
    print("reached")
except OSError as exc:
    print(f"unreachable: {exc}")
"""


# ---------------------------------------------------------------------- netns.py on its own


@needs_root
def test_a_nodes_network_is_made_idempotently_and_removed_whole(node_network: netns.NodeNetwork) -> None:
    node_id = "i-" + secrets.token_hex(9)[:17]
    address = str(node_network.subnet.network_address + 10)
    namespace = netns.ensure_node(node_network, node_id, address)
    assert namespace == netns.namespace_name(node_id)
    made = netns.leftovers(node_ids=[node_id], network=node_network)
    assert netns.ensure_node(node_network, node_id, address) == namespace  # again: nothing changes
    assert netns.leftovers(node_ids=[node_id], network=node_network) == made
    assert sorted(made) == sorted(
        [
            f"namespace {namespace}",
            f"hosts dir /etc/netns/{namespace}",
            f"veth {netns.veth_name(node_id)}",
            f"bridge {node_network.bridge}",
            f"route {node_network.subnet}",
        ]
    )
    assert len(netns.veth_name(node_id)) < netns.IFNAMSIZ
    assert netns.node_address(node_id) == address
    assert netns.bridge_namespaces(node_network) == [namespace]
    hosts = netns.hosts_path(namespace).read_text().splitlines()
    assert hosts[1].split() == [address, netns.GOSSIP_SERVICE]

    # Inside: its own name resolves to itself, the gateway answers (refused: nobody listens).
    code = (
        f"import socket; print(socket.gethostbyname('{netns.GOSSIP_SERVICE}')); s = socket.socket(); "
        f"s.settimeout(2); print(s.connect_ex(('{node_network.gateway}', 9)))"
    )
    run = subprocess.run(
        trampoline_argv(namespace, [sys.executable, "-c", code]), capture_output=True, text=True
    )
    assert run.stdout.split() == [address, "111"], run.stderr  # ECONNREFUSED: the gateway is there

    assert netns.set_partition(node_network, node_id, cut=True) is True
    assert netns.set_partition(node_network, node_id, cut=True) is False  # already cut
    assert netns.partitioned(node_network, node_id)
    run = subprocess.run(
        trampoline_argv(namespace, [sys.executable, "-c", code]), capture_output=True, text=True
    )
    assert run.stdout.split()[1] != "111"  # the blackhole: the gateway cannot be reached
    assert netns.set_partition(node_network, node_id, cut=False) is True
    assert netns.set_partition(node_network, node_id, cut=False) is False

    assert netns.remove_node(node_id) is True
    assert netns.remove_node(node_id) is False  # nothing left to remove
    assert netns.leftovers(node_ids=[node_id]) == []
    assert netns.remove_bridge(node_network) is True
    assert netns.remove_bridge(node_network) is False
    assert netns.leftovers(node_ids=[node_id], network=node_network) == []


@needs_root
def test_a_link_rate_is_a_token_bucket_on_the_nodes_link(node_network: netns.NodeNetwork) -> None:
    limited = netns.NodeNetwork(node_network.subnet, link_rate_mbit=80)
    node_id = "i-" + secrets.token_hex(9)[:17]
    netns.ensure_node(limited, node_id, str(node_network.subnet.network_address + 20))
    assert netns.link_rate_mbit(node_id) == 80
    netns.ensure_node(
        netns.NodeNetwork(node_network.subnet, link_rate_mbit=40),
        node_id,
        str(node_network.subnet.network_address + 20),
    )
    assert netns.link_rate_mbit(node_id) == 40  # replaced, not added
    netns.remove_node(node_id)


def test_addresses_come_from_the_subnet_never_the_bridges() -> None:
    network = netns.NodeNetwork.of("198.18.7.0/29")  # hosts .1 to .6: .1 and .2 are the bridge's
    drawn = {network.draw(lambda a: False, attempts=200) for _ in range(50)}
    assert drawn == {"198.18.7.3", "198.18.7.4", "198.18.7.5", "198.18.7.6"}
    assert network.draw(lambda a: True) is None
    assert network.gateway == "198.18.7.1"
    assert network.services == "198.18.7.2"
    assert len(network.bridge) < netns.IFNAMSIZ


def test_the_subnet_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert settings.provisioning.node_subnet == "198.18.0.0/16"
    assert ipaddress.IPv4Network(settings.provisioning.node_subnet).subnet_of(
        ipaddress.IPv4Network("198.18.0.0/15")
    )
    monkeypatch.setenv("HPSIM_PROVISIONING__NODE_NETWORK", "namespaces")
    monkeypatch.setenv("HPSIM_PROVISIONING__NODE_SUBNET", "198.19.4.0/24")
    settings = Settings(port=9999)
    assert settings.control_plane_url() == "http://198.19.4.1:9999"  # nodes reach it on the bridge
    for bad, why in (("198.19.4.0/30", "a /29 or larger"), ("10.0.0.300/24", "not an IPv4 subnet")):
        monkeypatch.setenv("HPSIM_PROVISIONING__NODE_SUBNET", bad)
        with pytest.raises(ValidationError, match=why):
            Settings()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_serve_without_the_privileges_says_what_is_missing(tmp_path: Path) -> None:
    argv = ["setpriv", "--bounding-set=-net_admin,-sys_admin", sys.executable, "-m", "hyperpod_sim", "serve"]
    argv += ["--port", "0", "--data-dir", str(tmp_path / "data"), "--node-network", "namespaces"]
    env = {
        **os.environ,
        "HPSIM_S3__EMBEDDED": "off",
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),
    }
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs CAP_NET_ADMIN" in done.stderr, done.stderr
    assert "CAP_SYS_ADMIN" in done.stderr, done.stderr
    assert "Run serve as root" in done.stderr


# ---------------------------------------------------------------------- serve in namespaces mode


@needs_root
def test_nodes_have_subnet_addresses_and_agents_answer_at_9200(
    ns_plane: ServerProcess, node_network: netns.NodeNetwork
) -> None:
    nodes = _cluster(ns_plane, "nets", 2)
    sm = ns_plane.client()
    addresses = set()
    for node in nodes:
        details = sm.describe_cluster_node(ClusterName="nets", NodeId=node["InstanceId"])["NodeDetails"]
        address = details["PrivatePrimaryIp"]
        assert ipaddress.IPv4Address(address) in node_network.subnet
        assert address not in (node_network.gateway, node_network.services)
        assert node["AgentStatus"]["Endpoint"] == f"http://{address}:9200"
        assert httpx.get(f"http://{address}:9200/health", timeout=5).status_code == 200  # from the host
        addresses.add(address)
    assert len(addresses) == 2
    assert netns.bridge_namespaces(node_network) == sorted(
        netns.namespace_name(n["InstanceId"]) for n in nodes
    )
    # The gateway answers the nodes' subnet only: this host's own address on the bridge is in it;
    # a client from another address (127.0.0.1 here; a LAN machine routing the subnet) is refused.
    assert httpx.get(f"http://{node_network.gateway}:{ns_plane.port}/health", timeout=5).status_code == 200
    outside = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.1"), timeout=5)
    with outside:
        refused = outside.get(f"http://{node_network.gateway}:{ns_plane.port}/health")
    assert refused.status_code == 403
    assert refused.json() == {
        "__type": "AccessDeniedException",
        "message": f"The control plane's address {node_network.gateway} answers the nodes' subnet "
        f"{node_network.subnet} only; call it at its own host address.",
    }


@needs_root
def test_node_exec_runs_inside_the_node_where_the_gossip_name_is_its_own(ns_plane: ServerProcess) -> None:
    nodes = _cluster(ns_plane, "inside", 2)
    for node in nodes:
        done = _node_exec(
            ns_plane,
            "inside",
            node["InstanceId"],
            f"""
            import json, os, socket, sys, urllib.request
            name = "{netns.GOSSIP_SERVICE}"
            with urllib.request.urlopen(f"http://{{name}}:9200/health", timeout=10) as answer:
                agent = answer.status
            with urllib.request.urlopen(os.environ["HPSIM_ENDPOINT_URL"] + "/health", timeout=10) as answer:
                control_plane = answer.status
            print(json.dumps({{"resolved": socket.gethostbyname(name), "agent": agent,
                              "control plane": control_plane, "address": os.environ["HPSIM_NODE_ADDRESS"],
                              "interfaces": sorted(os.listdir("/sys/class/net"))}}))
            sys.exit(4)
            """,
        )
        assert done.returncode == 4, done.stderr
        seen = json.loads(done.stdout)
        address = node["AgentStatus"]["Endpoint"].removeprefix("http://").removesuffix(":9200")
        assert seen == {
            "resolved": address,
            "agent": 200,
            "control plane": 200,
            "address": address,
            "interfaces": ["eth0", "lo"],
        }


@needs_root
def test_a_partition_cuts_the_node_from_the_control_plane_in_the_kernel(ns_plane: ServerProcess) -> None:
    nodes = _cluster(ns_plane, "split", 2)
    victim, other = nodes[0]["InstanceId"], nodes[1]["InstanceId"]
    assert _node_exec(ns_plane, "split", victim, PROBE).stdout.strip() == "reached"
    library = importlib.util.find_spec("amzn_sagemaker_checkpointing") is not None
    if library:  # a job that checkpoints on the node (its namespace is made through the control plane)
        assert _run_example(ns_plane, "split", victim, "job", steps=1) == {"loaded_step": 1, "equal": True}
    with HyperPodClient(ns_plane.url) as client:
        fault = client.inject_fault("split", Type="NetworkPartition", InstanceId=victim, DurationSeconds=600)
        during = _node_exec(ns_plane, "split", victim, PROBE).stdout.strip()
        assert during.startswith("unreachable"), during
        assert _node_exec(ns_plane, "split", other, PROBE).stdout.strip() == "reached"  # only the victim
        # The node's own agent still answers on the node (a trainer saves to it).
        local = _node_exec(
            ns_plane,
            "split",
            victim,
            f"import urllib.request; print(urllib.request.urlopen('http://{netns.GOSSIP_SERVICE}:9200/health').status)",
        )
        assert local.stdout.strip() == "200", local.stderr
        if library:  # its saves and loads go on, to and from the node's agent
            assert _run_example(ns_plane, "split", victim, "job", steps=3, first=2) == {
                "loaded_step": 3,
                "equal": True,
            }
        client.clear_fault("split", fault["FaultId"])
        wait_for(
            lambda: any(f"Fault {fault['FaultId']} ended" in t for t in descriptions(client, "split")),
            timeout=30,
            what="the partition to end",
        )
    after = _node_exec(ns_plane, "split", victim, PROBE).stdout.strip()
    assert after == "reached"


@needs_root
def test_namespaces_outlive_a_killed_serve_and_go_with_their_cluster(
    tmp_path: Path, node_network: netns.NodeNetwork, database_url: str
) -> None:
    server = serve_on(tmp_path, node_network, database_url).start()
    try:
        before = {n["InstanceId"]: n["AgentStatus"]["Endpoint"] for n in _cluster(server, "keep", 2)}
        server.kill()  # SIGKILL: nothing of serve's shutdown runs; the agents live on
        server = serve_on(tmp_path, node_network, database_url, port=server.port).start()
        with HyperPodClient(server.url) as client:
            wait_for(
                lambda: (
                    {
                        n["InstanceId"]: n.get("AgentStatus", {}).get("Endpoint")
                        for n in client.list_nodes("keep")
                    }
                    == before
                ),
                timeout=60,
                what="the same endpoints after the restart",
            )
        for endpoint in before.values():
            assert httpx.get(f"{endpoint}/health", timeout=5).status_code == 200
        # A reboot keeps the node's namespace and address: its agent is back at the same endpoint.
        rebooted = next(iter(before))
        server.client().batch_reboot_cluster_nodes(ClusterName="keep", NodeIds=[rebooted])
        with HyperPodClient(server.url) as client:
            wait_for(
                lambda: any(t.startswith(f"Node {rebooted} rebooted") for t in descriptions(client, "keep")),
                timeout=60,
                what="the reboot",
            )
            wait_for(
                lambda: any(
                    n["InstanceId"] == rebooted
                    and n["InstanceStatus"]["Status"] == "Running"
                    and n.get("AgentStatus", {}).get("Endpoint") == before[rebooted]
                    for n in client.list_nodes("keep")
                ),
                timeout=60,
                what="the rebooted node Running at its endpoint",
            )
        assert netns.node_address(rebooted) == before[rebooted].removeprefix("http://").removesuffix(":9200")
        assert httpx.get(f"{before[rebooted]}/health", timeout=5).status_code == 200
        server.client().delete_cluster(ClusterName="keep")
        wait_for(
            lambda: netns.leftovers(node_ids=list(before)) == [], timeout=90, what="the nodes' networks to go"
        )
    finally:
        server.stop()
        shutil.rmtree(shm_root_for(tmp_path), ignore_errors=True)


def test_local_agents_on_the_namespaces_network_register_at_their_subnet_addresses() -> None:
    from hyperpod_sim.domain.errors import AgentProtocolError
    from hyperpod_sim.domain.nodes.agent_inputs import check_endpoint

    subnet = "198.19.4.0/24"
    inside = "http://198.19.4.7:9200"
    assert check_endpoint(inside, loopback_only=True, node_subnet=subnet) == inside
    refusal = "or localhost, or an address of the nodes' subnet 198.19.4.0/24."
    with pytest.raises(AgentProtocolError, match=re.escape(refusal)):
        check_endpoint("http://198.19.5.7:9200", loopback_only=True, node_subnet=subnet)
    with pytest.raises(AgentProtocolError, match=r"or localhost\.$"):  # the loopback network: loopback only
        check_endpoint(inside, loopback_only=True)


@needs_root
def test_the_real_library_with_its_default_config_runs_unchanged_on_a_node(
    tmp_path: Path, node_network: netns.NodeNetwork
) -> None:
    """examples/checkpoint_default_config.py (no client config: the library calls the gossip service
    name) saves and loads through node exec; the node's agent persists the steps to the embedded
    SeaweedFS through the bridge's relay."""
    pytest.importorskip("amzn_sagemaker_checkpointing")
    server = serve_on(tmp_path, node_network, s3="seaweedfs").start()
    try:
        node = _cluster(server, "lib", 1)[0]["InstanceId"]
        with HyperPodClient(server.url) as client:
            client.put_checkpoint_policy("lib", S3BaseUri="s3://hpsim-checkpoints/lib", PersistEverySteps=1)
            client.wait_until_in_service("lib", timeout=60)
            assert _run_example(server, "lib", node, "job", steps=3) == {"loaded_step": 3, "equal": True}

            def persisted() -> list[int]:
                namespaces = client.checkpoints("lib")["Namespaces"]
                return sorted(s["Step"] for n in namespaces for s in n["Steps"] if s["S3"])

            wait_for(lambda: 3 in persisted(), timeout=60, what="step 3 in S3 (through the relay)")
    finally:
        server.stop()
        shutil.rmtree(shm_root_for(tmp_path), ignore_errors=True)
