"""The local provisioner: one ``hyperpod-sim agent`` process per node on this machine (the
default), and ``make_provisioner``, which picks the provisioner a control plane runs with.

Agents of the default agent command on the loopback or shared network are forked by the agent
launcher (infra/launcher.py, agents/launcher/: one interpreter that imported the agent once, about
13 MiB of PSS an agent instead of a fresh interpreter's 34); another command, and every agent of the
namespaces network, is exec'ed (``_forks`` decides). A forked agent is the launcher's child, not
this process's: it is known by its pidfile alone.

It stops an agent on scale-down, node deletion and DeleteCluster: SIGTERM, then SIGKILL after a
grace period in which the agent drains the checkpoints it has not persisted to S3 yet. The node
stays ShuttingDown (and a deleted cluster Deleting) until the process is gone, so that the agent
can still call the control plane while it drains.

It knows its agents by their process handle and by the pidfile it writes beside each agent's data
(``<data dir>/agents/<node id>/agent.pid``: pid, the kernel's start time, node id, the control
plane address it was given); every pass looks at those, never at the command lines of every
process. Signals go to the agent's process group (each runs in a session of its own, so the Ctrl+C
that the terminal sends to the control plane's process group does not reach it).

The agents live through a restart of the control plane (README, "What a restart keeps"). Its
shutdown stops them (``stop_agents``: SIGTERM, the agent drains to S3, SIGKILL after the grace
period; shared memory kept). Those that a killed control plane left running are found again by
their pidfiles and adopted by the next one (``adopt_agents``), never started twice. Only there, at
the start, and only for live nodes without a running pidfile here, one scan of /proc looks for
agents that no pidfile names: one whose control plane was killed before it wrote the pidfile, or
one of another control plane on the same database (another data dir), which is left to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hyperpod_sim.contracts import partition
from hyperpod_sim.domain.nodes import credentials
from hyperpod_sim.domain.provisioning import ExternalProvisioner, Provisioner, SimulatedProvisioner
from hyperpod_sim.infra import netns
from hyperpod_sim.infra.addresses import AGENT_PORT
from hyperpod_sim.infra.launcher import AgentLauncher
from hyperpod_sim.infra.netns_exec import trampoline_argv
from hyperpod_sim.infra.node_processes import ON_NODE, end_node_processes
from hyperpod_sim.infra.processes import (
    Pidfile,
    agent_processes,
    inherited_environment,
    signal_group,
    spawn,
    start_time,
    wipe_shared_memory,
)
from hyperpod_sim.models import Cluster, Node
from hyperpod_sim.settings import default_agent_command

log = logging.getLogger(__name__)


# What an agent inherits from the control plane's environment, beyond the base of every child
# (PATH, HOME, LANG/LC_*, TMPDIR, ...: infra/processes.py): what runs Python and finds this package,
# the agent's own settings (HPSIM_AGENT_*, agents/config.py: no other HPSIM_ setting is the
# agent's), and its S3 client's (AWS_*: the boto3 chain of the S3 tier; proxies and CA bundles).
# Never HPSIM_AUTH__*, HPSIM_DATABASE__* or another variable of serve's (docs/security.md).
SESSIONS_MARK = "sessions"  # in a node's agent dir: a command was started on the node
NETNS_VARIABLE = "HPSIM_NODE_NETNS"  # a session's: the node's network namespace (cli/nodes.py)

AGENT_ENV_NAMES = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        *(name for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY") for name in (proxy, proxy.lower())),
    }
)
AGENT_ENV_PREFIXES = ("HPSIM_AGENT_", "AWS_")


def agent_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the control plane's environment ``environ`` that its agents get."""
    return inherited_environment(environ, names=AGENT_ENV_NAMES, prefixes=AGENT_ENV_PREFIXES)


@dataclass
class _Agent:
    """An agent this provisioner started (``process``: spawned; None: forked by the agent launcher,
    whose child it is) or adopted from its pidfile. Without a handle, the pidfile tells whether it
    runs: pid and start time, a zombie counting as exited (the launcher collects it)."""

    pidfile: Pidfile
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.pidfile.pid

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None  # collects our exited child, so it is no zombie
        return self.pidfile.alive()


@dataclass
class LocalProvisioner:
    """Agents as child processes on this machine: each at port 9200 of its node's address (the
    loopback network), or on a free port of 127.0.0.1 (the shared network: a node without one)."""

    command: Sequence[str]
    control_plane_url: str
    data_dir: Path
    shm_root: Path = Path("/dev/shm/hpsim")
    kill_grace_s: float = 60.0
    # Variables every agent gets on top of what it inherits (agent_environment): the credentials of
    # the embedded S3 endpoint.
    agent_env: Mapping[str, str] = field(default_factory=dict)
    uses_agents: bool = True
    owns_agents: bool = True
    # The namespaces node network (infra/netns.py): each node a network namespace its agent runs
    # in, a NetworkPartition a route in it; None: the loopback or shared network.
    network: netns.NodeNetwork | None = None
    # The agent launcher (infra/launcher.py), started at the first launch it serves: see ``_forks``.
    launcher: AgentLauncher | None = None
    merge_agent_pages: bool = True  # SimulationSettings.merge_agent_pages, for the launcher
    # node id -> its agent, running or exited (until it is started again or its node is gone).
    _agents: dict[str, _Agent] = field(default_factory=dict)
    # node id -> when its agent was sent SIGTERM, for the SIGKILL of agents that do not stop.
    _stopping: dict[str, float] = field(default_factory=dict)
    # Deleted nodes whose shared memory goes once their agent is gone.
    _wipe: set[str] = field(default_factory=set)
    # Deleted nodes whose network namespace goes once their agent is gone (namespaces network).
    _unnet: set[str] = field(default_factory=set)

    def shm_dir(self, node_id: str) -> Path:
        return self.shm_root / node_id

    def agent_dir(self, node_id: str) -> Path:
        return self.data_dir / "agents" / node_id

    def _running(self, node_id: str) -> _Agent | None:
        agent = self._agents.get(node_id)
        return agent if agent is not None and agent.alive() else None

    def _forks(self) -> bool:
        """Whether this provisioner's agents are forked by the agent launcher: those of the default
        agent command on the loopback or shared network, on Linux (the launcher needs /proc and
        SO_PEERCRED). Another command (tests', users') is exec'ed as given, and the namespaces
        network execs each agent through its trampoline."""
        return (
            sys.platform == "linux" and self.network is None and list(self.command) == default_agent_command()
        )

    def _launcher(self) -> AgentLauncher:
        if self.launcher is None:
            base = {**agent_environment(os.environ), **self.agent_env}
            self.launcher = AgentLauncher(
                directory=self.data_dir / "launcher", env=base, merge_pages=self.merge_agent_pages
            )
        return self.launcher

    def launch(self, cluster: Cluster, node: Node) -> bool:
        if self._running(node.id) is not None:
            return False  # already running (a control plane restarted while its agents lived on)
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
        ]
        if node.address is not None:  # the loopback network: the node's address, HyperPod's port
            argv += ["--host", node.address, "--port", str(AGENT_PORT)]
        if self.network is not None and node.address is not None:
            # Its namespace first (idempotent: a restarted control plane finds it there), then the
            # agent inside it. NamespaceError is an OSError: a failed start, tried again.
            argv = trampoline_argv(netns.ensure_node(self.network, node.id, node.address), argv)
        # A new launch secret for this process only (the node registers with it, once; an earlier
        # process's stops working). It travels in the environment, not on the command line that
        # `ps` shows to every user; the database keeps only its digest.
        secret = credentials.bind_launch_secret(node)
        env = {**agent_environment(os.environ), **self.agent_env, "HPSIM_AGENT_TOKEN": secret}
        process: subprocess.Popen[bytes] | None = None
        if self._forks():
            pid = self._launcher().launch(argv, env=env, log_path=agent_dir / "agent.log")
        else:
            process = spawn(argv, env=env, log_path=agent_dir / "agent.log")
            pid = process.pid
        pidfile = Pidfile(
            pid=pid,
            start_time=start_time(pid) or -1,
            node_id=node.id,
            control_plane=self.control_plane_url,
        )
        pidfile.write(agent_dir)
        node.pid = pid
        self._agents[node.id] = _Agent(pidfile, process)
        log.info("started agent of %s (pid %d%s)", node.id, pid, ", forked" if process is None else "")
        return True

    def unlaunch(self, node_id: str) -> None:
        agent = self._agents.pop(node_id, None)
        if agent is None:
            return
        log.warning(
            "stopping agent of %s (pid %d): its launch secret was never committed", node_id, agent.pid
        )
        if agent.alive() and signal_group(agent.pid, signal.SIGKILL) and agent.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.process.wait(timeout=5)  # collected now, so that it is not left as a zombie

    def session_environment(self, cluster: Cluster, node: Node) -> dict[str, str]:
        """What a command run on the node gets in its environment (``node exec``, a job's ranks):
        its cluster, the node, its agent, its address and the control plane as the node reaches it,
        and the mark by which the node's end ends it (infra/node_processes.py). The node is
        remembered as having had commands, so that its end looks for them (a restart of serve
        included)."""
        agent_dir = self.agent_dir(node.id)
        agent_dir.mkdir(parents=True, exist_ok=True)
        (agent_dir / SESSIONS_MARK).touch()
        inside = {}
        if self.network is not None and node.address is not None:
            inside = {NETNS_VARIABLE: netns.namespace_name(node.id)}  # node exec runs CMD in it
        return {
            **inside,
            ON_NODE: node.id,
            "HPSIM_CLUSTER": cluster.name,
            "HPSIM_NODE_ID": node.id,
            "HPSIM_NODE_ADDRESS": node.address or "127.0.0.1",
            "HPSIM_AGENT_URL": node.endpoint or "",
            "HPSIM_ENDPOINT_URL": self.control_plane_url,
            "HPSIM_CONTROL_PLANE_URL": self.control_plane_url,
            "HPSIM_SIMULATION__SHM_ROOT": str(self.shm_root),
        }

    def end_node_processes(self, node: Node) -> list[int]:
        """End what runs on the node besides its agent, as losing the machine would (SIGKILL)."""
        if not (self.agent_dir(node.id) / SESSIONS_MARK).exists():
            return []
        ended = end_node_processes([node.id])
        if ended:
            log.info("ended %d process(es) on node %s: %s", len(ended), node.id, ended)
        return ended

    def terminate(self, node: Node) -> None:
        """Stop the agent of a deleted node (one SIGTERM, however often this is called); its
        shared memory goes once the agent has exited. What else runs on it ends at once."""
        self.end_node_processes(node)
        agent = self._running(node.id)
        if agent is not None and node.id not in self._stopping and signal_group(agent.pid, signal.SIGTERM):
            signal_group(agent.pid, signal.SIGCONT)  # a stopped (hung) agent must wake to see it
            self._stopping[node.id] = time.monotonic()
        if node.id in self._agents:  # an agent of another control plane's is left to it
            self._wipe.add(node.id)
        if self.network is not None:
            self._unnet.add(node.id)

    def has_stopped(self, node: Node) -> bool:
        stopped = self._running(node.id) is None
        if stopped and node.id in self._unnet:
            # Its agent has drained (it needed the network for that): its namespace goes now,
            # before its row, so that no restart of serve can lose track of it.
            try:
                netns.remove_node(node.id)
            except OSError as exc:
                log.warning("cannot remove the network of node %s yet (tried again): %s", node.id, exc)
                return False
            self._unnet.discard(node.id)
        return stopped

    def stop_agent(self, node: Node) -> None:
        """Stop the agent of a node that stays (a reboot): one SIGTERM (and SIGCONT, should it be
        hung), SIGKILL by ``reap`` after the grace period; its shared memory stays. What else runs
        on it ends at once, as a reboot ends a machine's processes."""
        self.end_node_processes(node)
        agent = self._running(node.id)
        if agent is not None and node.id not in self._stopping and signal_group(agent.pid, signal.SIGTERM):
            signal_group(agent.pid, signal.SIGCONT)
            self._stopping[node.id] = time.monotonic()

    def wipe_memory(self, node: Node) -> None:
        wipe_shared_memory(self.shm_dir(node.id))

    def is_ready(self, node: Node, now: datetime) -> bool:
        return False

    def exited_agents(self, node_ids: Collection[str]) -> set[str] | None:
        return {n for n in node_ids if n in self._agents and not self._agents[n].alive()}

    def adopt_agents(self, *, live: Collection[str], unregistered: Collection[str] = ()) -> set[str] | None:
        """Agents of this data dir that talk to another address (the control plane was killed and
        started on another port) cannot heartbeat here, and those of ``unregistered`` nodes may hold
        a launch secret that was never committed: they are stopped, and started again by the
        reconciler. The others are adopted as they are, and those of other data dirs (another
        control plane's, on one PostgreSQL database) left to their control plane."""
        found = self._pidfile_agents()
        elsewhere: set[str] = set()
        unknown = set(live) - set(found)
        if unknown:
            unrecorded, elsewhere = self._unrecorded_agents(unknown)
            found.update(unrecorded)
        restart = set(unregistered)
        stale = {
            node_id: a
            for node_id, a in found.items()
            if a.pidfile.control_plane != self.control_plane_url or node_id in restart
        }
        if stale:
            log.warning(
                "stopping %d agents started for another control plane address: %s",
                len(stale),
                ", ".join(f"{n} (pid {a.pid}, {a.pidfile.control_plane})" for n, a in stale.items()),
            )
            self._stop(stale.values())
        adopted = {node_id: a for node_id, a in found.items() if node_id not in stale}
        self._agents.update(adopted)
        return set(adopted) | elsewhere

    def _unrecorded_agents(self, node_ids: set[str]) -> tuple[dict[str, _Agent], set[str]]:
        """The one scan of /proc, at the start, for agents of ``node_ids`` that no pidfile names:
        those of this data dir (its control plane was killed before it wrote the pidfile), which
        get one now, and the node ids of those of other data dirs."""
        found: dict[str, _Agent] = {}
        elsewhere: set[str] = set()
        # Group leaders first: an agent's own child (a wrapper's agent) is not the one to adopt.
        for process in sorted(agent_processes(), key=lambda p: not _leads_group(p.pid)):
            node_id = process.node_id
            if node_id not in node_ids or node_id in found or node_id in elsewhere:
                continue
            mine = process.data_dir is not None and process.data_dir.parent == self.data_dir / "agents"
            started = start_time(process.pid)
            if started is None:
                continue  # gone meanwhile
            if not mine:
                elsewhere.add(node_id)
                continue
            pidfile = Pidfile(process.pid, started, node_id, process.control_plane or "")
            pidfile.write(self.agent_dir(node_id))
            found[node_id] = _Agent(pidfile)
        return found, elsewhere

    def _pidfile_agents(self) -> dict[str, _Agent]:
        """The running agents that this data dir's pidfiles name."""
        found = {}
        agents_dir = self.data_dir / "agents"
        for entry in os.scandir(agents_dir) if agents_dir.is_dir() else ():
            pidfile = Pidfile.read(Path(entry.path))
            if pidfile is not None and pidfile.node_id == entry.name and pidfile.alive():
                found[entry.name] = _Agent(pidfile)
        return found

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        """Stop the agents (serve's shutdown), then the agent launcher."""
        agents = [a for a in self._agents.values() if a.alive()]
        self._stop(agents, hurry=hurry)
        if self.launcher is not None:
            self.launcher.stop()
        return sorted(a.pidfile.node_id for a in agents)

    def _stop(self, agents: Iterable[_Agent], *, hurry: threading.Event | None = None) -> None:
        """SIGTERM ``agents`` and wait until they have exited: SIGKILL those still there after the
        kill grace period (at once once ``hurry`` is set). Their shared memory stays."""
        agents = list(agents)
        for agent in agents:
            if signal_group(agent.pid, signal.SIGTERM):
                self._stopping.setdefault(agent.pidfile.node_id, time.monotonic())
        for agent in agents:  # a stopped (hung) agent must wake to see the TERM
            signal_group(agent.pid, signal.SIGCONT)
        deadline = time.monotonic() + self.kill_grace_s
        killed = False
        while True:
            alive = [a for a in agents if a.alive()]
            if not alive:
                break
            pids = sorted(a.pid for a in alive)
            if not killed and (time.monotonic() >= deadline or (hurry is not None and hurry.is_set())):
                log.warning("agents %s did not stop in time; killing them", pids)
                for agent in alive:
                    signal_group(agent.pid, signal.SIGKILL)
                killed = True
                deadline = time.monotonic() + 10.0  # for the kernel to take them away
            elif killed and time.monotonic() >= deadline:
                log.error("agents %s are still there after SIGKILL", pids)
                return
            time.sleep(0.05)
        for agent in agents:
            Pidfile.remove(self.agent_dir(agent.pidfile.node_id))
        self.reap()

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        """SIGKILL the node's agent; with ``wipe_memory`` (the node is lost) everything else on
        it too, and its shared memory."""
        agent = self._running(node.id)
        pids = [agent.pid] if agent is not None and signal_group(agent.pid, signal.SIGKILL) else []
        if wipe_memory:
            self.end_node_processes(node)  # logged there; the answer names the agent's pids
        if agent is not None and agent.process is not None:
            # Collect our child now, so that it is not left as a zombie.
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.process.wait(timeout=5)
        if wipe_memory:
            wipe_shared_memory(self.shm_dir(node.id))
        return pids

    def _signal(self, node: Node, signum: int) -> list[int]:
        agent = self._running(node.id)
        return [agent.pid] if agent is not None and signal_group(agent.pid, signum) else []

    def pause_agent(self, node: Node) -> list[int]:
        return self._signal(node, signal.SIGSTOP)

    def resume_agent(self, node: Node) -> list[int]:
        return self._signal(node, signal.SIGCONT)

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        if self.network is not None and netns.namespace_exists(netns.namespace_name(node.id)):
            # In the kernel: a blackhole route to the control plane inside the node's namespace,
            # until the reconciler ends the fault (heal_agent); the agent knows nothing of it.
            netns.set_partition(self.network, node.id, cut=True)
        else:
            partition.write_rule(self.agent_dir(node.id), fault_id=fault_id, until=until)
        agent = self._running(node.id)
        return [agent.pid] if agent is not None else []

    def heal_agent(self, node: Node) -> bool:
        healed = partition.remove_rule(self.agent_dir(node.id))
        if self.network is not None:
            healed = netns.set_partition(self.network, node.id, cut=False) or healed
        return healed

    def reap(self) -> None:
        """Collect exited agents; SIGKILL those that ignore SIGTERM past the grace period; remove
        the shared memory (and the pidfile) of deleted nodes once their agent is gone."""
        for node_id, since in list(self._stopping.items()):
            agent = self._agents.get(node_id)
            if agent is None or not agent.alive():
                del self._stopping[node_id]
            elif time.monotonic() - since > self.kill_grace_s:
                log.warning(
                    "agent pid %d ignored SIGTERM for %.0f s; killing it", agent.pid, self.kill_grace_s
                )
                signal_group(agent.pid, signal.SIGKILL)
                del self._stopping[node_id]
        for agent in self._agents.values():
            if agent.process is not None:
                agent.alive()  # collects an exited child (one of the launcher's is the launcher's)
        for node_id in list(self._wipe):
            if self._running(node_id) is None:
                wipe_shared_memory(self.shm_dir(node_id))
                Pidfile.remove(self.agent_dir(node_id))
                self._agents.pop(node_id, None)
                self._wipe.discard(node_id)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def make_provisioner(
    mode: str,
    *,
    command: Sequence[str],
    control_plane_url: str,
    data_dir: Path,
    shm_root: Path,
    kill_grace_s: float,
    agent_env: Mapping[str, str] | None = None,
    network: netns.NodeNetwork | None = None,
    merge_agent_pages: bool = True,
) -> Provisioner:
    if mode == "simulated":
        return SimulatedProvisioner()
    if mode == "external":
        return ExternalProvisioner()
    return LocalProvisioner(
        command=command,
        control_plane_url=control_plane_url,
        data_dir=data_dir,
        shm_root=shm_root,
        kill_grace_s=kill_grace_s,
        agent_env=dict(agent_env or {}),
        network=network,
        merge_agent_pages=merge_agent_pages,
    )
