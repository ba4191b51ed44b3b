"""The namespaces node network in tests (issue 25): what its test modules share. Root only
(``needs_root``); each test gets a subnet of its own (``free_subnet``, the ``node_network``
fixture of tests/plugins/namespaces.py), and ``serve_on`` starts ``hyperpod-sim serve`` on it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from hyperpod_sim.infra import netns
from tests.conftest import ServerProcess, shm_root_for

MISSING = netns.missing_privileges() if os.geteuid() == 0 else ["root"]
needs_root = pytest.mark.skipif(
    bool(MISSING), reason=f"the namespaces network needs {', '.join(MISSING)} (CI runs as root)"
)


def free_subnet() -> netns.NodeNetwork:
    """A /24 of 198.19.0.0/16 that no bridge (another test's, another worker's) holds."""
    for _ in range(64):
        network = netns.NodeNetwork.of(f"198.19.{1 + secrets.randbelow(254)}.0/24")
        if not netns.bridge_exists(network) and not netns.network_namespaces(network):
            return network
    raise AssertionError("no free /24 of 198.19.0.0/16 for this test")


def serve_on(
    tmp_path: Path,
    network: netns.NodeNetwork,
    database_url: str | None = None,
    port: int | None = None,
    s3: str = "moto",
    heartbeat_timeout_s: float = 120.0,
) -> ServerProcess:
    """``serve`` (not started yet) in namespaces mode on ``network``. By default a partitioned node
    is not failed (and replaced) while a test measures it: a short ``heartbeat_timeout_s`` for a
    test whose lost node is to be replaced."""
    data_dir = tmp_path / "data"
    env = {
        "HPSIM_PROVISIONING__NODE_NETWORK": "namespaces",
        "HPSIM_PROVISIONING__NODE_SUBNET": str(network.subnet),
        "HPSIM_S3__EMBEDDED": s3,
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),
    }
    return ServerProcess(database_url or f"sqlite:///{tmp_path / 'cp.db'}", data_dir, env=env, port=port)


def processes_under(path: Path) -> list[int]:
    """The processes whose command line names ``path`` (the agents of a test's data dir)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    if str(path).encode() in handle.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found
