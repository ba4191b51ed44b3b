"""Provisioners: what brings a node's agent up and down.

- ``LocalProvisioner`` (default) starts one ``hyperpod-sim agent`` process per node on this machine
  and stops it on scale-down, node deletion and DeleteCluster: SIGTERM, then SIGKILL after a grace
  period in which the agent drains the checkpoints it has not persisted to S3 yet. The node stays
  ShuttingDown (and a deleted cluster Deleting) until the process is gone, so that the agent can
  still call the control plane while it drains.
- ``ExternalProvisioner`` starts nothing: agents started elsewhere register with the cluster's
  bootstrap token and are bound to pending node slots; a deleted node's agent learns it from its
  next heartbeat (404) and exits.
- ``SimulatedProvisioner`` has no agents at all: a node is Running once its launch delay passed.
  For API-only use (tests of the AWS surface, the control-plane benchmark).

Only the local provisioner owns its agents' processes, so only it can restart a crashed agent
(the reconciler asks ``running_agents``) and inject node faults (``kill_agent``, ``pause_agent``,
``resume_agent``; domain/faults.py).

The local provisioner's agents live through a restart of the control plane (README, "What a
restart keeps"). Each runs in a session of its own, so the Ctrl+C that the terminal sends to the
control plane's process group does not reach it, and only the control plane's shutdown stops it
(``stop_agents``: SIGTERM, the agent drains to S3, SIGKILL after the grace period; shared memory
kept). Agents that a killed control plane left running are found again by their command line
(``agent_processes``) and adopted by the next one (``adopt_agents``), never started twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from contracts import partition
from domain import credentials
from models import Cluster, Node

log = logging.getLogger(__name__)


class Provisioner(Protocol):
    #: Whether nodes have agents (registration, heartbeats, policy pushes).
    uses_agents: bool

    def launch(self, cluster: Cluster, node: Node) -> None:
        """Start the node's agent. Called after the node's row is committed, in a transaction that
        holds the cluster row (the agent's registration waits for it): a provisioner that starts
        the process binds the node to a launch secret (domain/credentials.py) and hands it to that
        process only. May raise OSError."""

    def terminate(self, node: Node) -> None:
        """Stop the node's agent, if this provisioner owns it. Called on every reconcile pass while
        the node is ShuttingDown, so it must be idempotent."""

    def has_stopped(self, node: Node) -> bool:
        """Whether a ShuttingDown node's agent is gone, so that its row (and, once every node's is,
        a deleted cluster's) can go too."""

    def adopt_agents(self, *, unregistered: Collection[str] = ()) -> set[str] | None:
        """At the control plane's start: the node ids whose agent process still runs and talks to
        this control plane (left by one that was killed), which are adopted as they are; None:
        cannot tell (agents started elsewhere come back by themselves). The agents of
        ``unregistered`` nodes (never registered) are stopped instead, to be started again: the
        control plane that started them may have been killed before it committed their launch
        secrets, and then they could never register."""

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        """At the control plane's stop: stop every agent process it runs and wait until they have
        exited (each drains to S3 first; SIGKILL after the grace period, or at once when ``hurry``
        is set); their shared memory stays. The node ids whose agent was stopped."""

    def is_ready(self, node: Node, now: datetime) -> bool:
        """Simulated mode only: whether the launch delay has passed."""

    def reap(self) -> None:
        """Collect exited agent processes; force the stop of those that ignore SIGTERM."""

    #: Whether it owns the agents' processes: restarts crashed agents, injects node faults.
    owns_agents: bool

    def running_agents(self) -> set[str] | None:
        """Node ids whose agent process exists on this machine; None: cannot tell."""

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        """SIGKILL the node's agent (a crash); with ``wipe_memory`` its shared memory goes too (the
        node is lost). The pids killed."""

    def pause_agent(self, node: Node) -> list[int]:
        """SIGSTOP the node's agent (a hang: its port stays open, nothing answers). The pids."""

    def resume_agent(self, node: Node) -> list[int]:
        """SIGCONT the node's agent. The pids."""

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        """Cut the node off from the control plane until ``until`` (epoch seconds) or until healed
        (contracts/partition.py); trainers and peers still reach it. The pids of its agent."""

    def heal_agent(self, node: Node) -> bool:
        """End the node's partition; whether it had one."""


class _NoProcesses:
    """Provisioners that own no agent processes: nothing to restart, no node faults."""

    owns_agents = False

    def running_agents(self) -> set[str] | None:
        return None

    def adopt_agents(self, *, unregistered: Collection[str] = ()) -> set[str] | None:
        return None

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        return []

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def pause_agent(self, node: Node) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def resume_agent(self, node: Node) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def heal_agent(self, node: Node) -> bool:
        raise NotImplementedError("this provisioner owns no agent processes")


class SimulatedProvisioner(_NoProcesses):
    uses_agents = False

    def launch(self, cluster: Cluster, node: Node) -> None:
        return None

    def terminate(self, node: Node) -> None:
        return None

    def has_stopped(self, node: Node) -> bool:
        return True

    def is_ready(self, node: Node, now: datetime) -> bool:
        return now >= node.ready_at

    def reap(self) -> None:
        return None


class ExternalProvisioner(_NoProcesses):
    uses_agents = True

    def launch(self, cluster: Cluster, node: Node) -> None:
        log.info("node %s of %s waits for an external agent", node.id, cluster.name)

    def terminate(self, node: Node) -> None:
        return None

    def has_stopped(self, node: Node) -> bool:
        # Nothing here can see the agent: it learns of the deletion from the 404 that answers its
        # next heartbeat, and the row goes at once.
        return True

    def is_ready(self, node: Node, now: datetime) -> bool:
        return False

    def reap(self) -> None:
        return None


@dataclass(frozen=True)
class AgentProcess:
    """An agent process on this machine, as its command line describes it."""

    pid: int
    node_id: str
    control_plane: str | None
    data_dir: Path | None


def _flag(argv: list[bytes], name: bytes) -> str | None:
    index = argv.index(name) + 1 if name in argv else len(argv)
    return argv[index].decode(errors="replace") if index < len(argv) else None


def agent_processes() -> list[AgentProcess]:
    """Every agent process on this machine with a node id (one pass over /proc): a command line
    with an argument ending in ``agent`` and ``--node-id``. A zombie has none, so is not one."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        node_id = _flag(argv, b"--node-id")
        if node_id is None or not any(arg.endswith(b"agent") for arg in argv):
            continue
        data_dir = _flag(argv, b"--data-dir")
        found.append(
            AgentProcess(
                pid=int(entry.name),
                node_id=node_id,
                control_plane=_flag(argv, b"--control-plane"),
                data_dir=Path(data_dir) if data_dir is not None else None,
            )
        )
    return found


def find_agent_pids(node_id: str) -> list[int]:
    """Processes on this machine running the agent of ``node_id`` (by their command line)."""
    return [agent.pid for agent in agent_processes() if agent.node_id == node_id]


def agent_node_ids() -> set[str]:
    """The node ids of every agent process on this machine."""
    return {agent.node_id for agent in agent_processes()}


def _signal_all(pids: list[int], signum: int) -> list[int]:
    sent = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            sent.append(pid)
    return sent


@dataclass
class LocalProvisioner:
    """Agents as child processes on loopback ports of this machine."""

    command: Sequence[str]
    control_plane_url: str
    data_dir: Path
    heartbeat_interval_s: float
    shm_root: Path = Path("/dev/shm/hpsim")
    kill_grace_s: float = 60.0
    # Variables every agent gets on top of the control plane's environment (the credentials of
    # the embedded S3 endpoint).
    agent_env: Mapping[str, str] = field(default_factory=dict)
    uses_agents: bool = True
    owns_agents: bool = True
    _children: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    # pid -> when SIGTERM was sent, for the SIGKILL of agents that do not stop.
    _stopping: dict[int, float] = field(default_factory=dict)
    # Shared memory of deleted nodes, removed once their agent is gone: node id -> pids.
    _wipe: dict[str, list[int]] = field(default_factory=dict)

    def shm_dir(self, node_id: str) -> Path:
        return self.shm_root / node_id

    def agent_dir(self, node_id: str) -> Path:
        return self.data_dir / "agents" / node_id

    def launch(self, cluster: Cluster, node: Node) -> None:
        if find_agent_pids(node.id):
            return  # already running (a control plane restarted while its agents lived on)
        agent_dir = self.agent_dir(node.id)
        agent_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            *self.command,
            *("--control-plane", self.control_plane_url),
            *("--cluster", cluster.name),
            *("--node-id", node.id),
            *("--instance-type", node.instance_type),
            *("--data-dir", str(agent_dir)),
            *("--shm-dir", str(self.shm_dir(node.id))),
            *("--heartbeat-interval", str(self.heartbeat_interval_s)),
        ]
        # A new launch secret for this process only (the node registers with it, once; an earlier
        # process's stops working). It travels in the environment, not on the command line that
        # `ps` shows to every user; the database keeps only its digest.
        secret = credentials.bind_launch_secret(node)
        env = {**os.environ, **self.agent_env, "HPSIM_AGENT_TOKEN": secret}
        with open(agent_dir / "agent.log", "ab") as logfile:
            # A session of its own: the SIGINT of a Ctrl+C in the control plane's terminal goes to
            # the control plane's process group only; its shutdown stops the agents (stop_agents).
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        node.pid = process.pid
        self._children[process.pid] = process
        log.info("started agent of %s (pid %d)", node.id, process.pid)

    def terminate(self, node: Node) -> None:
        """Stop the agent of a deleted node (one SIGTERM per process, however often this is
        called); its shared memory goes once the agent has exited."""
        pids = find_agent_pids(node.id)
        for pid in pids:
            if pid in self._stopping:
                continue  # told already; reap() kills it when its grace period is over
            try:
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)  # a stopped (hung) agent must wake to see the TERM
            except ProcessLookupError:
                continue
            self._stopping[pid] = time.monotonic()
        if pids or node.id not in self._wipe:
            self._wipe[node.id] = pids

    def has_stopped(self, node: Node) -> bool:
        return not find_agent_pids(node.id)

    def is_ready(self, node: Node, now: datetime) -> bool:
        return False

    def running_agents(self) -> set[str] | None:
        return agent_node_ids()

    def _own(self, agent: AgentProcess) -> bool:
        """Whether this control plane started ``agent`` (its data dir is under this one's)."""
        return agent.data_dir is not None and agent.data_dir.parent == self.data_dir / "agents"

    def adopt_agents(self, *, unregistered: Collection[str] = ()) -> set[str] | None:
        """Agents of this data dir that talk to another address (the control plane was killed and
        started on another port) cannot heartbeat here, and those of ``unregistered`` nodes may hold
        a launch secret that was never committed: they are stopped, and started again by the
        reconciler. The others, and those of other data dirs (another control plane's, on one
        PostgreSQL database), are left as they are."""
        agents = agent_processes()
        restart = set(unregistered)
        stale = [
            a
            for a in agents
            if self._own(a) and (a.control_plane != self.control_plane_url or a.node_id in restart)
        ]
        if stale:
            log.warning(
                "stopping %d agents started for another control plane address: %s",
                len(stale),
                ", ".join(f"{a.node_id} (pid {a.pid}, {a.control_plane})" for a in stale),
            )
            self._stop(stale)
        stopped = {a.pid for a in stale}
        return {a.node_id for a in agents if a.pid not in stopped}

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        agents = [a for a in agent_processes() if self._own(a)]
        self._stop(agents, hurry=hurry)
        return sorted({a.node_id for a in agents})

    def _stop(self, agents: Iterable[AgentProcess], *, hurry: threading.Event | None = None) -> None:
        """SIGTERM ``agents`` and wait until they have exited: SIGKILL those still there after the
        kill grace period (at once once ``hurry`` is set). Their shared memory stays."""
        pids = {a.pid for a in agents}
        for pid in _signal_all(sorted(pids), signal.SIGTERM):
            self._stopping.setdefault(pid, time.monotonic())
        _signal_all(sorted(pids), signal.SIGCONT)  # a stopped (hung) agent must wake to see the TERM
        deadline = time.monotonic() + self.kill_grace_s
        killed = False
        while True:
            self.reap()  # our own children are collected, so they do not linger as zombies
            alive = pids & {a.pid for a in agent_processes()}
            if not alive:
                return
            if not killed and (time.monotonic() >= deadline or (hurry is not None and hurry.is_set())):
                log.warning("agents %s did not stop in time; killing them", sorted(alive))
                _signal_all(sorted(alive), signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + 10.0  # for the kernel to take them away
            elif killed and time.monotonic() >= deadline:
                log.error("agents %s are still there after SIGKILL", sorted(alive))
                return
            time.sleep(0.05)

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        pids = _signal_all(find_agent_pids(node.id), signal.SIGKILL)
        for pid in pids:  # collect our children now, so they are not left as zombies
            child = self._children.pop(pid, None)
            if child is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=5)
        if wipe_memory:
            shutil.rmtree(self.shm_dir(node.id), ignore_errors=True)
        return pids

    def pause_agent(self, node: Node) -> list[int]:
        return _signal_all(find_agent_pids(node.id), signal.SIGSTOP)

    def resume_agent(self, node: Node) -> list[int]:
        return _signal_all(find_agent_pids(node.id), signal.SIGCONT)

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        partition.write_rule(self.agent_dir(node.id), fault_id=fault_id, until=until)
        return find_agent_pids(node.id)

    def heal_agent(self, node: Node) -> bool:
        return partition.remove_rule(self.agent_dir(node.id))

    def reap(self) -> None:
        for pid, process in list(self._children.items()):
            if process.poll() is not None:
                del self._children[pid]
                self._stopping.pop(pid, None)
        for pid, since in list(self._stopping.items()):
            if not os.path.exists(f"/proc/{pid}"):
                del self._stopping[pid]
            elif time.monotonic() - since > self.kill_grace_s:
                log.warning("agent pid %d ignored SIGTERM for %.0f s; killing it", pid, self.kill_grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                del self._stopping[pid]
        for node_id, pids in list(self._wipe.items()):
            if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
                shutil.rmtree(self.shm_dir(node_id), ignore_errors=True)
                del self._wipe[node_id]


def make_provisioner(
    mode: str,
    *,
    command: Sequence[str],
    control_plane_url: str,
    data_dir: Path,
    heartbeat_interval_s: float,
    shm_root: Path,
    kill_grace_s: float,
    agent_env: Mapping[str, str] | None = None,
) -> Provisioner:
    if mode == "simulated":
        return SimulatedProvisioner()
    if mode == "external":
        return ExternalProvisioner()
    return LocalProvisioner(
        command=command,
        control_plane_url=control_plane_url,
        data_dir=data_dir,
        heartbeat_interval_s=heartbeat_interval_s,
        shm_root=shm_root,
        kill_grace_s=kill_grace_s,
        agent_env=dict(agent_env or {}),
    )
