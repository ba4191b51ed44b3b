"""The reconciler: drives clusters from their desired state (groups, target counts, status) to
their observed state (nodes), and moves cluster status along the transition table.

All of its state is in the database, so a restarted control plane picks up where the last one
stopped. Each cluster is reconciled in its own transaction with the cluster row locked
(``FOR UPDATE SKIP LOCKED`` on PostgreSQL), so two control planes on one database never work on
the same cluster at once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session, selectinload

from domain.clock import Clock, Ids
from domain.lifecycle import ClusterStatus, GroupStatus, NodeStatus, check_transition
from models import Cluster, Database, InstanceGroup, Node, Tag

log = logging.getLogger(__name__)


class Provisioner(Protocol):
    """What brings nodes up and down. Simulated here; real agent processes replace it later."""

    def launch(self, node: Node, now: datetime) -> None: ...

    def is_ready(self, node: Node, now: datetime) -> bool: ...

    def terminate(self, node: Node) -> None: ...


class SimulatedProvisioner:
    """A node is Running once its ``ready_at`` has passed (the configured launch delay)."""

    def launch(self, node: Node, now: datetime) -> None:
        return None

    def is_ready(self, node: Node, now: datetime) -> bool:
        return now >= node.ready_at

    def terminate(self, node: Node) -> None:
        return None


@dataclass
class Outcome:
    """What one reconcile pass over one cluster did."""

    changed: bool = False
    # Another pass right away can make progress (nodes to remove, a deletion under way).
    again: bool = False
    # The earliest time something is due (a pending node's ready time), to sleep until then.
    due: datetime | None = None

    def note_due(self, when: datetime) -> None:
        self.due = when if self.due is None else min(self.due, when)


class Reconciler:
    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        ids: Ids,
        provisioner: Provisioner,
        node_ready_delay_s: float,
        interval_s: float,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.provisioner = provisioner
        self.node_ready_delay_s = node_ready_delay_s
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            timeout = self.interval_s
            try:
                due = self.run_once()
                if due is not None:
                    timeout = min(timeout, max(0.0, (due - self.clock.now()).total_seconds()))
            except Exception:  # a failed pass is retried on the next tick
                log.exception("reconcile pass failed")
            self._wake.wait(timeout)

    # ------------------------------------------------------------------ passes

    def pending_cluster_ids(self) -> list[str]:
        """Clusters with work to do: in a transitional status, or with nodes in transit."""
        busy_nodes = select(Node.cluster_id).where(
            Node.status.in_([NodeStatus.PENDING, NodeStatus.SHUTTING_DOWN])
        )
        query = select(Cluster.id).where(
            or_(
                Cluster.status.in_([ClusterStatus.CREATING, ClusterStatus.UPDATING, ClusterStatus.DELETING]),
                Cluster.id.in_(busy_nodes),
            )
        )
        with self.db.read() as session:
            return list(session.scalars(query))

    def run_once(self) -> datetime | None:
        """Reconcile every cluster with work, pass after pass while one leaves more to do;
        return when something is next due."""
        due: datetime | None = None
        for cluster_id in self.pending_cluster_ids():
            for _ in range(100):  # a pass per status step; bounded in case of a bug
                outcome = self.reconcile(cluster_id)
                if outcome.due is not None:
                    due = outcome.due if due is None else min(due, outcome.due)
                if not (outcome.changed and outcome.again):
                    break
        return due

    def reconcile(self, cluster_id: str) -> Outcome:
        outcome = Outcome()
        with self.db.write() as session:
            cluster = session.scalars(
                select(Cluster)
                .where(Cluster.id == cluster_id)
                .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
                .with_for_update(skip_locked=True)
            ).one_or_none()
            if cluster is None:  # gone, or another control plane holds it
                return outcome
            self._step(session, cluster, outcome)
        return outcome

    def _step(self, session: Session, cluster: Cluster, outcome: Outcome) -> None:
        now = self.clock.now()
        # 1. Nodes that are shutting down go away.
        for node in list(cluster.nodes):
            if node.status == NodeStatus.SHUTTING_DOWN:
                self.provisioner.terminate(node)
                cluster.nodes.remove(node)
                session.delete(node)
                outcome.changed = True

        if cluster.status == ClusterStatus.DELETING:
            for node in cluster.nodes:
                node.status = NodeStatus.SHUTTING_DOWN
                outcome.changed = outcome.again = True
            if not cluster.nodes:
                session.execute(delete(Tag).where(Tag.resource_arn == cluster.arn))
                session.delete(cluster)
                outcome.changed = True
            return

        live_by_group: dict[str, list[Node]] = {}
        for node in cluster.nodes:
            live_by_group.setdefault(node.group_name, []).append(node)

        # 2. Groups being deleted drain their nodes, then disappear.
        for group in list(cluster.instance_groups):
            if group.status != GroupStatus.DELETING:
                continue
            nodes = live_by_group.get(group.name, [])
            for node in nodes:
                node.status = NodeStatus.SHUTTING_DOWN
            if not nodes:
                cluster.instance_groups.remove(group)
                session.delete(group)
            outcome.changed = outcome.again = True

        # 3. Scale each group to its target, and bring pending nodes up, in the same pass: with
        # no launch delay a new cluster goes Creating -> InService in one transaction.
        converged = True
        for group in cluster.instance_groups:
            if group.status == GroupStatus.DELETING:
                converged = False
                continue
            nodes = live_by_group.get(group.name, [])
            if len(nodes) < group.target_count:
                launched = [self._launch(cluster, group, now) for _ in range(group.target_count - len(nodes))]
                cluster.nodes.extend(launched)
                nodes = nodes + launched
                outcome.changed = True
            elif len(nodes) > group.target_count:
                # Scale down: pending nodes first, then the newest.
                by_preference = sorted(
                    nodes, key=lambda n: (n.status != NodeStatus.PENDING, -n.launch_time.timestamp())
                )
                surplus = len(nodes) - group.target_count
                for node in by_preference[:surplus]:
                    node.status = NodeStatus.SHUTTING_DOWN
                nodes = by_preference[surplus:]
                outcome.changed = True
                converged = False
            for node in nodes:
                if node.status == NodeStatus.PENDING:
                    if self.provisioner.is_ready(node, now):
                        node.status = NodeStatus.RUNNING
                        outcome.changed = True
                    else:
                        outcome.note_due(node.ready_at)
                        converged = False
        if any(n.status == NodeStatus.SHUTTING_DOWN for n in cluster.nodes):
            converged = False
            outcome.again = True

        # 4. Status follows convergence.
        if converged and cluster.status in (ClusterStatus.CREATING, ClusterStatus.UPDATING):
            cluster.status = check_transition(cluster.status, ClusterStatus.IN_SERVICE)
            cluster.updated_time = now
            for group in cluster.instance_groups:
                group.status = GroupStatus.IN_SERVICE
            outcome.changed = True

    def _launch(self, cluster: Cluster, group: InstanceGroup, now: datetime) -> Node:
        node_id = self.ids.node_id()
        node = Node(
            id=node_id,
            cluster_id=cluster.id,
            group_name=group.name,
            logical_id=f"{group.name}-{node_id[2:]}",
            instance_type=group.instance_type,
            status=NodeStatus.PENDING,
            status_message=None,
            launch_time=now,
            ready_at=now + timedelta(seconds=self.node_ready_delay_s),
            private_ip=self.ids.private_ip(),
        )
        self.provisioner.launch(node, now)
        return node
