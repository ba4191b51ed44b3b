"""``node_network`` and ``ns_plane``: a subnet of the test's own on the namespaces node
network, and ``serve`` on it (tests/node_namespaces.py). Afterwards nothing of the subnet is left
(namespace, veth, bridge, route, hosts file): asserted, also when the test failed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpod_sim.infra import netns
from tests.conftest import ServerProcess, kill_processes_under, shm_root_for, wait_for
from tests.node_namespaces import free_subnet, processes_under, serve_on


@pytest.fixture
def node_network(tmp_path: Path) -> Iterator[netns.NodeNetwork]:
    """A subnet of this test's own; afterwards nothing of it is left (asserted)."""
    network = free_subnet()
    try:
        yield network
    finally:
        kill_processes_under(tmp_path)  # agents and ranks a failed test left running in the namespaces
        nodes = [n.removeprefix(netns.NAMESPACE_PREFIX) for n in netns.network_namespaces(network)]
        netns.remove_network(network)
        left = netns.leftovers(node_ids=nodes, network=network) + netns.network_namespaces(network)
        assert left == [], f"left behind: {left}"


@pytest.fixture
def ns_plane(tmp_path: Path, node_network: netns.NodeNetwork) -> Iterator[ServerProcess]:
    """``serve`` in namespaces mode on the test's subnet (stopped before the network's finalizer)."""
    server = serve_on(tmp_path, node_network).start()
    try:
        yield server
        server.stop()
        # serve's stop ends its agents inside the namespaces too (their namespaces stay).
        wait_for(lambda: not processes_under(tmp_path), timeout=30, what="the agents to stop with serve")
    finally:
        server.stop()
        shutil.rmtree(shm_root_for(tmp_path), ignore_errors=True)
