"""What a reconcile pass, and each of its phases, did to one cluster (hyperpod_sim/domain/reconciler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from hyperpod_sim.contracts.policy import NodePolicy


@dataclass(frozen=True)
class Push:
    """One policy push, claimed in a transaction and sent after it."""

    node_id: str
    endpoint: str
    token: str  # the node's control-plane token: only this control plane and that agent know it
    policy: NodePolicy


@dataclass
class Outcome:
    """What one reconcile pass over one cluster did, or one phase of it (merged into the pass's)."""

    changed: bool = False
    # Another pass right away can make progress (nodes to remove, pushes answered, ...).
    again: bool = False
    # The earliest time something is due (a launch delay, a push retry, a heartbeat deadline).
    due: datetime | None = None
    launches: list[str] = field(default_factory=list)
    pushes: list[Push] = field(default_factory=list)
    # Nodes whose crashed agent waits out its restart backoff: not failed for missed heartbeats.
    restart_pending: set[str] = field(default_factory=set)
    # Whether the phase found its part of the cluster as desired (every group at its target, every
    # node Running with the current policy, nothing shutting down), but for the nodes ``behind``.
    converged: bool = True
    # Running nodes whose agent has not applied the cluster's policy generation yet: in a rollout,
    # all that stands between a pass and convergence (the reconciler settles it once they have).
    behind: set[str] = field(default_factory=set)

    @property
    def settled(self) -> bool:
        """Converged, with no node behind."""
        return self.converged and not self.behind

    def note_due(self, when: datetime) -> None:
        self.due = when if self.due is None else min(self.due, when)

    def merge(self, other: Outcome) -> Outcome:
        """Add a phase's outcome to this one; this one."""
        self.changed |= other.changed
        self.again |= other.again
        if other.due is not None:
            self.note_due(other.due)
        self.launches.extend(other.launches)
        self.pushes.extend(other.pushes)
        self.restart_pending |= other.restart_pending
        self.converged &= other.converged
        self.behind |= other.behind
        return self
