"""infra/: the local provisioner's process tracking on its own, with stand-in agents (a Python
that sleeps): pidfiles, liveness by start time, adoption by a control plane started again, and
the stop of agents started for another address. No control plane, no HTTP."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hyperpod_sim.contracts.processes import start_time
from hyperpod_sim.infra.local import LocalProvisioner
from hyperpod_sim.infra.processes import Pidfile, signal_group
from hyperpod_sim.models import Cluster, Node
from tests.conftest import wait_for

# Its command line ends an argument with "agent", as ``hyperpod-sim agent`` does.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", "agent"]


def provisioner(tmp_path: Path, url: str = "http://127.0.0.1:1") -> LocalProvisioner:
    return LocalProvisioner(
        command=SLEEPER,
        control_plane_url=url,
        data_dir=tmp_path / "data",
        shm_root=tmp_path / "shm",
        kill_grace_s=5.0,
    )


def node(node_id: str) -> Node:
    return Node(id=node_id, instance_type="ml.g5.2xlarge")


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalProvisioner]:
    made = provisioner(tmp_path)
    yield made
    made.stop_agents()


def test_launch_writes_a_pidfile_and_tracks_the_process(local: LocalProvisioner, tmp_path: Path) -> None:
    one = node("i-1")
    local.launch(Cluster(name="c"), one)
    pidfile = Pidfile.read(local.agent_dir("i-1"))
    assert pidfile is not None
    assert (pidfile.pid, pidfile.node_id, pidfile.control_plane) == (one.pid, "i-1", "http://127.0.0.1:1")
    assert pidfile.alive()
    assert pidfile.start_time == start_time(pidfile.pid)
    assert one.launch_secret_hash is not None  # bound to a secret of this process only
    local.launch(Cluster(name="c"), one)  # already running: not started twice
    assert Pidfile.read(local.agent_dir("i-1")) == pidfile
    assert local.exited_agents(["i-1", "i-other"]) == set()  # i-other is not this one's
    (local.shm_dir("i-1")).mkdir(parents=True)
    assert local.kill_agent(one, wipe_memory=True) == [pidfile.pid]
    assert local.exited_agents(["i-1"]) == {"i-1"}
    assert not local.shm_dir("i-1").exists()
    # A pid the kernel gave to another process is not the agent: the start time differs.
    assert not Pidfile(pidfile.pid, pidfile.start_time + 1, "i-1", "x").alive()


def test_terminate_waits_for_the_agent_then_wipes_its_memory(local: LocalProvisioner) -> None:
    one = node("i-1")
    local.launch(Cluster(name="c"), one)
    local.shm_dir("i-1").mkdir(parents=True)
    local.terminate(one)
    local.terminate(one)  # idempotent: one SIGTERM
    wait_for(lambda: local.has_stopped(one), timeout=10, what="the agent to stop")
    local.reap()
    assert not local.shm_dir("i-1").exists()
    assert Pidfile.read(local.agent_dir("i-1")) is None


def test_a_restarted_control_plane_adopts_its_agents_and_stops_stale_ones(tmp_path: Path) -> None:
    first = provisioner(tmp_path)
    for node_id in ("i-kept", "i-unregistered"):
        first.launch(Cluster(name="c"), node(node_id))
    moved = provisioner(tmp_path / "moved", url="http://127.0.0.1:2")
    moved.launch(Cluster(name="c"), node("i-moved"))
    kept = Pidfile.read(first.agent_dir("i-kept"))
    assert kept is not None
    try:
        # first is killed: its agents live on. The next control plane adopts them by pidfile.
        again = provisioner(tmp_path)
        running = again.adopt_agents(
            live=["i-kept", "i-unregistered", "i-gone"], unregistered=["i-unregistered"]
        )
        assert running == {"i-kept"}  # i-unregistered was stopped, to be started again; i-gone has none
        assert Pidfile.read(first.agent_dir("i-unregistered")) is None
        assert again.exited_agents(["i-kept"]) == set()
        assert again.pause_agent(node("i-kept")) == [kept.pid]
        assert again.resume_agent(node("i-kept")) == [kept.pid]
        # On another address, the same data dir's agents cannot heartbeat: stopped.
        elsewhere = provisioner(tmp_path / "moved", url="http://127.0.0.1:3")
        assert elsewhere.adopt_agents(live=["i-moved"]) == set()
        # A pidfile that was never written (killed right after the start): found by the one scan.
        Pidfile.remove(first.agent_dir("i-kept"))
        third = provisioner(tmp_path)
        assert third.adopt_agents(live=["i-kept"]) == {"i-kept"}
        assert Pidfile.read(first.agent_dir("i-kept")) == kept
        assert again.stop_agents() == ["i-kept"]
        assert start_time(kept.pid) is None
    finally:
        for made in (first, moved):
            for pidfile in [Pidfile.read(made.agent_dir(n)) for n in ("i-kept", "i-unregistered", "i-moved")]:
                if pidfile is not None and pidfile.alive():
                    signal_group(pidfile.pid, signal.SIGKILL)
            made.stop_agents()
