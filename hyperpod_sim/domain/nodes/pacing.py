"""How often agents heartbeat, and how long a silent one has, as the number of agents grows.

Every heartbeat is a request and a write transaction of the control plane's: at one a second, 64
agents cost it a seventh of a core, 1,024 would cost more than two. Up to ``full_rate_nodes``
agents (across every cluster), each heartbeats every ``interval_s``; beyond it the interval grows in
proportion, so the control plane hears about as many heartbeats a second at any size (the
Kubernetes node lease makes the same trade). The heartbeat timeout grows with it: at least
``MISSES`` intervals, never less than the configured ``timeout_s``. An agent learns its interval
at registration and from every heartbeat's answer; one that was told a longer interval keeps it
until its next heartbeat, so a timeout never shrinks below ``MISSES`` times an interval still in
use.

A crashed agent of the local provisioner is noticed by its process's exit, not by its silence,
at the reconciler's next pass: pacing slows that pass down too (``slowdown``, at most 4 times), so
a killed agent's node is noticed within seconds at any size, a hung one's after the timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

# Heartbeats a paced agent may miss before its node fails.
MISSES = 5
# The most the reconciler's periodic pass is slowed down by (HeartbeatPacing.slowdown).
MAX_SLOWDOWN = 4.0


@dataclass
class HeartbeatPacing:
    interval_s: float  # the configured interval (HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S)
    timeout_s: float  # the configured timeout (HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S)
    full_rate_nodes: int = 64  # agents that all heartbeat at ``interval_s``
    # Cluster id -> its nodes with an agent, as the reconciler's last pass over it counted them.
    _agents: dict[str, int] = field(default_factory=dict)
    # The longest interval answered that may still be in use, and until when (monotonic).
    _longest: tuple[float, float] = (0.0, 0.0)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, cluster_id: str, agents: int) -> None:
        """The cluster has ``agents`` nodes with an agent (0: it is gone)."""
        with self._lock:
            if agents:
                self._agents[cluster_id] = agents
            else:
                self._agents.pop(cluster_id, None)

    def retain(self, cluster_ids: Collection[str]) -> None:
        """Only ``cluster_ids`` exist (the others were deleted)."""
        with self._lock:
            for gone in set(self._agents) - set(cluster_ids):
                del self._agents[gone]

    def agents(self) -> int:
        with self._lock:
            return sum(self._agents.values())

    def _current(self) -> float:
        return self.interval_s * self._factor()

    def _factor(self) -> float:
        return max(1.0, sum(self._agents.values()) / self.full_rate_nodes)

    def slowdown(self) -> float:
        """How much longer than configured the control plane's periodic work may wait: the
        heartbeat interval's growth, at most ``MAX_SLOWDOWN`` (the reconciler's pass over every
        node, which notices a crashed agent's exit, runs at least every 4 configured intervals)."""
        with self._lock:
            return min(self._factor(), MAX_SLOWDOWN)

    def interval(self) -> float:
        """The interval to answer an agent now (remembered for the timeout until it has passed)."""
        with self._lock:
            value = self._current()
            now = time.monotonic()
            longest, until = self._longest
            if value >= longest or now >= until:
                self._longest = (value, now + MISSES * value)
            return value

    def timeout(self) -> float:
        """How long a node's agent may be silent before the node fails."""
        with self._lock:
            longest, until = self._longest
            in_use = max(self._current(), longest if time.monotonic() < until else 0.0)
            if in_use <= self.interval_s:
                return self.timeout_s
            return max(self.timeout_s, MISSES * in_use)
