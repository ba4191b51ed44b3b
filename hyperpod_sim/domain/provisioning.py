"""Provisioners: what brings a node's agent up and down, as the domain sees it.

- ``LocalProvisioner`` (default; hyperpod_sim/infra/local.py, which ``make_provisioner`` there picks from)
  starts one ``hyperpod-sim agent`` process per node on this machine and stops it on scale-down,
  node deletion and DeleteCluster; the node stays ShuttingDown (and a deleted cluster Deleting)
  until the process is gone, so that the agent can still call the control plane while it drains.
- ``ExternalProvisioner`` starts nothing: agents started elsewhere register with the cluster's
  bootstrap token and are bound to pending node slots; a deleted node's agent learns it from its
  next heartbeat (404) and exits.
- ``SimulatedProvisioner`` has no agents at all: a node is Running once its launch delay passed.
  For API-only use (tests of the AWS surface, the control-plane benchmark).

Only the local provisioner owns its agents' processes, so only it can restart a crashed agent
(the reconciler asks ``exited_agents``) and inject node faults (``kill_agent``, ``pause_agent``,
``resume_agent``; hyperpod_sim/domain/faults.py). Its agents live through a restart of the control plane
(README, "What a restart keeps"): the next one adopts them (``adopt_agents``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from datetime import datetime
from typing import Protocol

from hyperpod_sim.models import Cluster, Node

log = logging.getLogger(__name__)


class Provisioner(Protocol):
    #: Whether nodes have agents (registration, heartbeats, policy pushes).
    uses_agents: bool

    def launch(self, cluster: Cluster, node: Node) -> bool:
        """Start the node's agent. Called after the node's row is committed, in a transaction that
        holds the cluster row (the agent's registration waits for it): a provisioner that starts
        the process binds the node to a launch secret (domain/nodes/credentials.py) and hands it to that
        process only. Whether it started a process (not when one already runs). May raise OSError."""

    def unlaunch(self, node_id: str) -> None:
        """Undo a :meth:`launch` whose transaction failed (the database did not answer): its agent
        holds a launch secret the database never recorded, so it could never register. SIGKILL it
        and forget it (not an exited agent, nor a failed start: the reconciler starts it again);
        its shared memory stays."""

    def terminate(self, node: Node) -> None:
        """Stop the node's agent, if this provisioner owns it. Called on every reconcile pass while
        the node is ShuttingDown, so it must be idempotent."""

    def has_stopped(self, node: Node) -> bool:
        """Whether a ShuttingDown node's agent is gone, so that its row (and, once every node's is,
        a deleted cluster's) can go too."""

    def stop_agent(self, node: Node) -> None:
        """Stop the agent of a node that stays (a reboot, a software update): SIGTERM once (it
        drains to S3), SIGKILL after the grace period; its shared memory stays until
        ``wipe_memory``. Idempotent; ``has_stopped`` tells when it is gone."""

    def wipe_memory(self, node: Node) -> None:
        """Clear the node's shared memory (a reboot: the shards it held are gone)."""

    def adopt_agents(self, *, live: Collection[str], unregistered: Collection[str] = ()) -> set[str] | None:
        """At the control plane's start: of the ``live`` nodes (Pending or Running), those whose
        agent process still runs (left by a control plane that was killed: adopted as they are;
        or another control plane's: left to it); None: cannot tell (agents started elsewhere come
        back by themselves). The others' agents are started again. The agents of
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

    def exited_agents(self, node_ids: Collection[str]) -> set[str] | None:
        """Of ``node_ids``, those whose agent this provisioner started (or adopted) and whose
        process has gone since (to be started again); None: cannot tell."""

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        """SIGKILL the node's agent (a crash); with ``wipe_memory`` its shared memory goes too (the
        node is lost). The pids killed."""

    def pause_agent(self, node: Node) -> list[int]:
        """SIGSTOP the node's agent (a hang: its port stays open, nothing answers). The pids."""

    def resume_agent(self, node: Node) -> list[int]:
        """SIGCONT the node's agent. The pids."""

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        """Cut the node off from the control plane until ``until`` (epoch seconds) or until healed
        (hyperpod_sim/contracts/partition.py); trainers and peers still reach it. The pids of its agent."""

    def heal_agent(self, node: Node) -> bool:
        """End the node's partition; whether it had one."""

    def session_environment(self, cluster: Cluster, node: Node) -> dict[str, str]:
        """What a command run on the node of ``cluster`` gets in its environment (``node exec``
        and a job's ranks: the cluster, the node, its agent, the control plane as the node reaches
        it); the node's end ends such commands."""


class _NoProcesses:
    """Provisioners that own no agent processes: nothing to restart, no node faults."""

    owns_agents = False

    def exited_agents(self, node_ids: Collection[str]) -> set[str] | None:
        return None

    def adopt_agents(self, *, live: Collection[str], unregistered: Collection[str] = ()) -> set[str] | None:
        return None

    def stop_agent(self, node: Node) -> None:
        return None

    def terminate(self, node: Node) -> None:
        return None

    def unlaunch(self, node_id: str) -> None:
        return None

    def wipe_memory(self, node: Node) -> None:
        return None

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        return []

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def pause_agent(self, node: Node) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def session_environment(self, cluster: Cluster, node: Node) -> dict[str, str]:
        raise NotImplementedError("this provisioner runs nothing on its nodes")

    def resume_agent(self, node: Node) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        raise NotImplementedError("this provisioner owns no agent processes")

    def heal_agent(self, node: Node) -> bool:
        raise NotImplementedError("this provisioner owns no agent processes")


class SimulatedProvisioner(_NoProcesses):
    uses_agents = False

    def launch(self, cluster: Cluster, node: Node) -> bool:
        return False

    def has_stopped(self, node: Node) -> bool:
        return True

    def is_ready(self, node: Node, now: datetime) -> bool:
        return now >= node.ready_at

    def reap(self) -> None:
        return None


class ExternalProvisioner(_NoProcesses):
    uses_agents = True

    def launch(self, cluster: Cluster, node: Node) -> bool:
        log.info("node %s of %s waits for an external agent", node.id, cluster.name)
        return False

    def has_stopped(self, node: Node) -> bool:
        # Nothing here can see the agent: it learns of the deletion from the 404 that answers its
        # next heartbeat, and the row goes at once.
        return True

    def is_ready(self, node: Node, now: datetime) -> bool:
        return False

    def reap(self) -> None:
        return None
