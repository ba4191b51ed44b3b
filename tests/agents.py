"""Node agents as real processes, as their tests see them: node details over REST, an agent's
policy, its memory budget, a tiered cluster, its events, an agent started by hand."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from hyperpod_sim.domain.instance_types import instance_memory_bytes
from tests.conftest import EKS, ControlPlane, ServerProcess, group, shm_root_for
from tests.conftest import wait_status as conftest_wait_status

SCALE = 1 / 1024  # the default simulation scale


def expected_budget(instance_type: str, percentage: int) -> int:
    return int(instance_memory_bytes(instance_type) * percentage / 100 * SCALE)


def nodes(plane: ControlPlane | ServerProcess, name: str) -> list[dict[str, Any]]:
    """Node details over REST, which carries the AgentStatus extension."""
    listing = httpx.get(f"{plane.url}/clusters/{name}/nodes", timeout=10).json()
    details = []
    for summary in listing["ClusterNodeSummaries"]:
        response = httpx.get(f"{plane.url}/clusters/{name}/nodes/{summary['InstanceId']}", timeout=10)
        if response.status_code == 404:
            continue  # removed between the listing and now
        details.append(response.json()["NodeDetails"])
    return details


def agent_policy(node: dict[str, Any]) -> dict[str, Any]:
    policy: dict[str, Any] = httpx.get(f"{node['AgentStatus']['Endpoint']}/v1/policy", timeout=10).json()
    return policy


# conftest's, with room for agent processes starting on a busy machine.
wait_status = functools.partial(conftest_wait_status, timeout=90)


def create_tiered(sm: Any, name: str, count: int, percentage: int = 20, **kwargs: Any) -> None:
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[group("workers", count)],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
        **kwargs,
    )


def event_texts(sm: Any, name: str) -> list[str]:
    pages = sm.get_paginator("list_cluster_events").paginate(ClusterName=name, SortOrder="Ascending")
    return [e["Description"] for page in pages for e in page["Events"]]


def start_agent(plane_url: str, cluster: str, token: str, data_dir: Path) -> subprocess.Popen[bytes]:
    """An agent started by hand, as docker compose or a DaemonSet would (external provisioning)."""
    argv = [sys.executable, "-m", "hyperpod_sim", "agent", "--control-plane", plane_url, "--cluster", cluster]
    argv += ["--data-dir", str(data_dir), "--heartbeat-interval", "0.2"]
    argv += ["--shm-dir", str(shm_root_for(data_dir.parent) / data_dir.name)]
    with open(data_dir.with_suffix(".log"), "wb") as log:
        return subprocess.Popen(
            argv, env={**os.environ, "HPSIM_AGENT_TOKEN": token}, stdout=subprocess.DEVNULL, stderr=log
        )


def connections_to(endpoint: str, *, established: bool = True) -> set[int]:
    """The local ports of this process's established TCP connections to the agent at ``endpoint``
    (``http://host:port``, IPv4): ``/proc/self/fd`` against ``/proc/self/net/tcp``. Not
    ``established``: its sockets in any state, a connection the agent closed but this process
    never did (CLOSE_WAIT) included."""
    url = urlsplit(endpoint)
    # /proc/net/tcp's remote address: the IPv4 address as a little-endian hex word, then the port.
    wanted = f"{socket.inet_aton(url.hostname or '').hex()}"
    wanted = "".join(reversed([wanted[i : i + 2] for i in range(0, 8, 2)])).upper() + f":{url.port:04X}"
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if (state == "01" or not established) and inode in inodes and remote == wanted:
            ports.add(int(local.split(":")[1], 16))
    return ports
