"""The reconciler: drives clusters from their desired state (groups, target counts, policy
generation, status) to their observed state (nodes, agents, acknowledged generations).

All of its state is in the database, so a restarted control plane picks up where the last one
stopped: pending launches, unacknowledged policy generations, push retries and their backoff.
Each cluster is reconciled in its own transaction with the cluster row locked (``FOR UPDATE SKIP
LOCKED`` on PostgreSQL). Policy pushes are claimed in that transaction (``push_claimed_until``)
and sent afterwards, in parallel, outside any transaction; so two control planes on one database
never work on the same cluster at once, nor push the same generation to the same node twice.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, case, delete, func, or_, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.domain import events, faults
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.checkpoints.cluster_policy import S3Endpoint
from hyperpod_sim.domain.checkpoints.pushes import PUSHED, PolicyPusher, PushConfig, PushResult, claim_pushes
from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.domain.lifecycle import (
    LEAVING,
    LIVE,
    ClusterStatus,
    GroupStatus,
    NodeStatus,
    bump_generation,
)
from hyperpod_sim.domain.node_operations import health_checks, software_update
from hyperpod_sim.domain.node_operations import reboot_replace as node_operations
from hyperpod_sim.domain.nodes import recovery
from hyperpod_sim.domain.nodes.health import NodeHealth
from hyperpod_sim.domain.nodes.node_set import NO_ADDRESSES, NodeAddresses, new_node
from hyperpod_sim.domain.nodes.pacing import HeartbeatPacing
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.models import Cluster, Database, InstanceGroup, Node, Tag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcilerConfig:
    interval_s: float
    node_ready_delay_s: float
    heartbeat_timeout_s: float
    launch_timeout_s: float
    memory_scale: float
    s3_endpoint: S3Endpoint
    push_workers: int
    push_timeout_s: float
    push_backoff_s: float
    push_backoff_max_s: float
    # Restart the crashed agent of a Pending or Running node (local provisioner), as a kubelet
    # restarts a daemon, instead of letting its node fail.
    restart_agents: bool = True
    # Bounded failure loops (hyperpod_sim/domain/nodes/recovery.py): failed starts of a node's agent before
    # its node fails, and replacements in a row of a slot's nodes that failed before registering.
    start_attempts: int = 4
    replace_limit: int = 3
    # Where new nodes' addresses come from (hyperpod_sim/domain/nodes/node_set.py).
    addresses: NodeAddresses = NO_ADDRESSES
    # Heartbeats: the configured interval, and how many agents all heartbeat at it
    # (hyperpod_sim/domain/nodes/pacing.py).
    heartbeat_interval_s: float = 1.0
    heartbeat_full_rate_nodes: int = 64


class Reconciler:
    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        ids: Ids,
        provisioner: Provisioner,
        config: ReconcilerConfig,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.provisioner = provisioner
        self.config = config
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pusher = PolicyPusher(
            db=db,
            clock=clock,
            ids=ids,
            workers=config.push_workers,
            config=PushConfig(
                timeout_s=config.push_timeout_s,
                backoff_s=config.push_backoff_s,
                backoff_max_s=config.push_backoff_max_s,
                memory_scale=config.memory_scale,
                s3_endpoint=config.s3_endpoint,
            ),
        )
        # Shared with the agents' service, which answers each agent its interval.
        self.pacing = HeartbeatPacing(
            interval_s=config.heartbeat_interval_s,
            timeout_s=config.heartbeat_timeout_s,
            full_rate_nodes=config.heartbeat_full_rate_nodes,
        )
        self.health = NodeHealth(
            ids=ids,
            provisioner=provisioner,
            pacing=self.pacing,
            launch_timeout_s=config.launch_timeout_s,
            node_ready_delay_s=config.node_ready_delay_s,
            restart_agents=config.restart_agents,
            start_attempts=config.start_attempts,
            replace_limit=config.replace_limit,
            addresses=config.addresses,
        )
        self._adopted = False
        # When this control plane came up: no node is failed for the silence before (its agent
        # could not reach a control plane that was down), as none is for a database outage's.
        self._up_since = clock.now()
        # Nodes whose agent this control plane started again at its start (README, "What a restart
        # keeps"): each has as long to register as a new node's.
        self._started_again: set[str] = set()
        # Cluster id -> nodes whose agent start was asked for by a pass whose launch transaction
        # then failed (the database did not answer): started by the next pass over the cluster.
        self._unlaunched: dict[str, set[str]] = {}
        self._stopped = False

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        self._up_since = self.clock.now()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self._thread.start()

    def stop(self, *, hurry: threading.Event | None = None) -> None:
        """Stop reconciling, then stop the agents this control plane runs (each drains to S3
        first; ``hurry``: kill those still draining) and wait for them: nothing it started
        outlives it. Their nodes stay as they are, shared memory included, and the next start
        starts their agents again (``_adopt_agents``). Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.pusher.close()
        if self._stopped:
            return
        self._stopped = True
        stopped = self.provisioner.stop_agents(hurry=hurry)
        if stopped:
            self._record_start_or_stop(dict.fromkeys(stopped, "stopped"), _stopping)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            # A pass reads every node of every cluster: past the heartbeats' full rate it runs less
            # often, as heartbeats do (at most 4 intervals apart). What is due sooner, and every
            # change made through the API, still wakes it at once.
            timeout = self.config.interval_s * self.pacing.slowdown()
            try:
                due = self.run_once()
                if due is not None:
                    timeout = min(timeout, max(0.0, (due - self.clock.now()).total_seconds()))
            except OperationalError as exc:  # the database is down: retried on the next tick
                log.warning("reconcile pass failed, the database is unavailable: %s", exc.orig)
            except Exception:  # a failed pass is retried on the next tick
                log.exception("reconcile pass failed")
            self._wake.wait(timeout)

    # ------------------------------------------------------------------ passes

    def pending_cluster_ids(self) -> list[str]:
        """Clusters with work to do. With agents, every cluster: heartbeats are watched always."""
        query = select(Cluster.id)
        if not self.provisioner.uses_agents:
            busy_nodes = select(Node.cluster_id).where(
                Node.status.in_(
                    [
                        NodeStatus.PENDING,
                        NodeStatus.SHUTTING_DOWN,
                        NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
                        NodeStatus.DETACH_IN_PROGRESS,
                        NodeStatus.ATTACH_IN_PROGRESS,
                    ]
                )
            )
            query = query.where(
                or_(
                    Cluster.status.in_(
                        [
                            ClusterStatus.CREATING,
                            ClusterStatus.UPDATING,
                            ClusterStatus.DELETING,
                            ClusterStatus.SYSTEM_UPDATING,
                        ]
                    ),
                    Cluster.id.in_(busy_nodes),
                )
            )
        with self.db.read() as session:
            return list(session.scalars(query))

    def run_once(self) -> datetime | None:
        """Reconcile every cluster with work, pass after pass while one leaves more to do;
        return when something is next due."""
        self.provisioner.reap()
        faults.report_ended_outage(db=self.db, clock=self.clock, ids=self.ids)
        if not self._adopted:
            self._adopt_agents()
        due: datetime | None = None
        cluster_ids = self.pending_cluster_ids()
        if self.provisioner.uses_agents:  # every cluster is listed: those not listed are gone
            self.pacing.retain(cluster_ids)
            self.pusher.retain(cluster_ids)
        for cluster_id in cluster_ids:
            for _ in range(100):  # a pass per status step; bounded in case of a bug
                try:
                    outcome = self.reconcile(cluster_id)
                except OperationalError:
                    raise  # the database is down: the whole pass is retried on the next tick
                except Exception:
                    # One cluster's failure (a bug, a node's bad data) must not stop the others.
                    log.exception("reconcile of cluster %s failed; going on with the others", cluster_id)
                    break
                if outcome.due is not None:
                    due = outcome.due if due is None else min(due, outcome.due)
                if not (outcome.changed and outcome.again):
                    break
        return due

    def reconcile(self, cluster_id: str) -> Outcome:
        """One pass over one cluster in one transaction; then, outside it, the agents it launched
        start and the pushes it claimed are sent."""
        with self.db.write() as session:
            cluster = session.scalars(
                select(Cluster)
                .where(Cluster.id == cluster_id)
                .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
                .with_for_update(skip_locked=True)
            ).one_or_none()
            if cluster is None:  # gone, or another control plane holds it
                self.pacing.count(cluster_id, 0)
                return Outcome()
            outcome = self.step(session, cluster)
            self.pacing.count(cluster_id, sum(1 for n in cluster.nodes if n.endpoint and n.status in LIVE))
            pushed = {
                (n.endpoint, n.push_token)
                for n in cluster.nodes
                if n.status in PUSHED and n.endpoint is not None and n.push_token is not None
            }
            rollout = None
            if outcome.behind and outcome.converged and cluster.status in _SETTLING:
                rollout = Rollout(cluster.generation, ClusterStatus(cluster.status), len(cluster.nodes))
        if self.provisioner.uses_agents:
            self.pusher.hold(cluster_id, pushed)
        if outcome.launches or cluster_id in self._unlaunched:
            self._launch_agents(cluster_id, outcome.launches)
            outcome.again = outcome.changed = True
        if outcome.pushes:
            results = self.pusher.send(outcome.pushes)
            resets = self.pusher.record(cluster_id, results)
            if resets:
                again = [push for push in outcome.pushes if push.node_id in resets]
                self.pusher.record(cluster_id, self.pusher.send(again, reset=True))
            outcome.again = outcome.changed = True
            if not resets and rollout is not None and _caught_up(outcome, results, rollout.generation):
                # The pass found the cluster converged but for the nodes it pushed to, and every
                # one has applied the generation: settled here, without a second pass over every
                # node (at 1,024 nodes, 50-70 ms of each rollout's).
                outcome.again = not self.settle_rollout(cluster_id, rollout)
        return outcome

    def settle_rollout(self, cluster_id: str, rollout: Rollout) -> bool:
        """InService after a rollout whose pass saw every other part of the cluster converged, if
        nothing changed since but the acknowledgements: the same policy generation and status,
        and the same number of nodes, each Running with the generation applied (one query, not
        every node's row). Whether it did; if not, the next pass decides as usual."""
        with self.db.write() as session:
            cluster = session.scalars(
                select(Cluster)
                .where(Cluster.id == cluster_id)
                .options(selectinload(Cluster.instance_groups))
                .with_for_update(skip_locked=True)
            ).one_or_none()
            if cluster is None or (cluster.generation, cluster.status) != rollout.seen:
                return False
            current = case(
                (and_(Node.status == NodeStatus.RUNNING, Node.acked_generation >= rollout.generation), 1),
                else_=0,
            )
            total, caught_up = session.execute(
                select(func.count(), func.coalesce(func.sum(current), 0)).where(Node.cluster_id == cluster_id)
            ).one()
            if not total == caught_up == rollout.nodes:
                return False
            now = self.clock.now()
            self.settle_status(session, cluster, now, converged=True, running=total)
            operations.settle(session, cluster=cluster, now=now)
        return True

    # ------------------------------------------------------------------ phases

    def step(self, session: Session, cluster: Cluster) -> Outcome:
        """One pass over a locked cluster, phase by phase; what they did together."""
        now = self.clock.now()
        outcome = self.remove_stopped_nodes(session, cluster)
        if cluster.status == ClusterStatus.DELETING:
            return outcome.merge(self.finish_deletion(session, cluster, now))
        outcome.merge(self.end_faults(session, cluster, now))
        outcome.merge(
            software_update.roll(
                session,
                cluster,
                now,
                ids=self.ids,
                provisioner=self.provisioner,
                launch_timeout_s=self.config.launch_timeout_s,
            )
        )
        outcome.merge(health_checks.finish_health_checks(session, cluster, now, ids=self.ids))
        reboots = node_operations.carry_out_restarts(
            session,
            cluster,
            now,
            ids=self.ids,
            provisioner=self.provisioner,
            ready_delay_s=self.config.node_ready_delay_s,
        )
        outcome.merge(reboots)
        if self.provisioner.uses_agents:
            restarts = self.health.restart_crashed_agents(session, cluster, now)
            outcome.merge(restarts)
            starts = self.health.retry_starts(session, cluster, now, launching=set(outcome.launches))
            outcome.merge(starts)
            outcome.merge(
                self.health.detect_failures(
                    session,
                    cluster,
                    now,
                    back=self._back_since(),
                    restart_pending=(
                        restarts.restart_pending | reboots.restart_pending | starts.restart_pending
                    ),
                    started_again_and_silent=self._started_again_and_silent,
                )
            )
        members_before = _members(cluster)
        outcome.merge(self.drain_deleted_groups(session, cluster, now))
        outcome.merge(self.scale_groups(session, cluster, now))
        # The node set changed outside an update (a scale step after BatchDeleteClusterNodes, ...):
        # the replica ring changed, so every node needs a new policy generation.
        if _members(cluster) != members_before and cluster.status == ClusterStatus.IN_SERVICE:
            bump_generation(cluster)
        if self.provisioner.uses_agents:
            outcome.merge(claim_pushes(session, cluster, now, self.pusher.config))
        outcome.merge(self.settle_status(session, cluster, now, converged=outcome.settled))
        operations.settle(session, cluster=cluster, now=now)  # its operation Done once it is InService
        return outcome

    def remove_stopped_nodes(self, session: Session, cluster: Cluster) -> Outcome:
        """Nodes that are shutting down go away once their agent has stopped. An agent told to
        stop drains its unpersisted checkpoints to S3 first, calling the control plane as it does
        (namespaces, events): so the node's row, and a deleted cluster's, stay until then. The
        provisioner bounds the wait (SIGKILL after its grace period)."""
        outcome = Outcome()
        for node in list(cluster.nodes):
            if node.status == NodeStatus.SHUTTING_DOWN:
                self.provisioner.terminate(node)
                if not self.provisioner.has_stopped(node):
                    continue  # looked at again on the next tick
                cluster.nodes.remove(node)
                session.delete(node)
                outcome.changed = True
        return outcome

    def finish_deletion(self, session: Session, cluster: Cluster, now: datetime) -> Outcome:
        """A Deleting cluster shuts its nodes down; once they are gone, so is it (tags included)."""
        outcome = Outcome(converged=False)
        for node in cluster.nodes:
            if node.status != NodeStatus.SHUTTING_DOWN:
                events.move(session, node, NodeStatus.SHUTTING_DOWN, ids=self.ids, now=now)
                outcome.changed = outcome.again = True
        if not cluster.nodes:
            session.execute(delete(Tag).where(Tag.resource_arn == cluster.arn))
            session.delete(cluster)
            outcome.changed = True
        return outcome

    def end_faults(self, session: Session, cluster: Cluster, now: datetime) -> Outcome:
        """Faults whose duration is over end (hyperpod_sim/domain/faults.py)."""
        changed, due = faults.end_due_faults(
            session, ids=self.ids, now=now, cluster=cluster, provisioner=self.provisioner
        )
        outcome = Outcome(changed=changed)
        if due is not None:
            outcome.note_due(due)
        return outcome

    def drain_deleted_groups(self, session: Session, cluster: Cluster, now: datetime) -> Outcome:
        """Groups being deleted shut their nodes down, then disappear."""
        outcome = Outcome()
        live = _live_by_group(cluster)
        for group in list(cluster.instance_groups):
            if group.status != GroupStatus.DELETING:
                continue
            nodes = live.get(group.name, [])
            for node in nodes:
                events.move(session, node, NodeStatus.SHUTTING_DOWN, ids=self.ids, now=now)
            if not nodes:
                cluster.instance_groups.remove(group)
                session.delete(group)
            outcome.changed = outcome.again = True
        return outcome

    def scale_groups(self, session: Session, cluster: Cluster, now: datetime) -> Outcome:
        """Scale each group to its target, and bring pending nodes up, in the same pass: with no
        launch delay a simulated cluster goes Creating -> InService in one transaction. Converged:
        every group at its target, every node Running with the current policy."""
        outcome = Outcome()
        live = _live_by_group(cluster)
        for group in cluster.instance_groups:
            if group.status == GroupStatus.DELETING:
                outcome.converged = False
                continue
            nodes = live.get(group.name, [])
            if len(nodes) < group.target_count:
                nodes = nodes + [
                    self._new_node(session, cluster, group, now, outcome)
                    for _ in range(group.target_count - len(nodes))
                ]
                outcome.changed = True
            elif len(nodes) > group.target_count:
                nodes = self._scale_down(session, cluster, nodes, group.target_count, now)
                outcome.changed = True
                outcome.converged = False
            for node in nodes:
                up = self._bring_up(session, cluster, node, now, outcome)
                # A failed node that its group's stopped recovery keeps (domain/nodes/recovery.py) holds
                # no update up: the cluster says why in its FailureMessage.
                if up or (node.status == NodeStatus.FAILURE and group.recovery_stopped is not None):
                    continue
                if self._behind(cluster, node):
                    outcome.behind.add(node.id)
                else:
                    outcome.converged = False
        if any(n.status == NodeStatus.SHUTTING_DOWN for n in cluster.nodes):
            outcome.converged = False
            outcome.again = True
        return outcome

    def _scale_down(
        self, session: Session, cluster: Cluster, nodes: list[Node], target: int, now: datetime
    ) -> list[Node]:
        """Shut down the surplus of ``nodes`` over ``target``: failed nodes first, then pending
        ones, then the newest. The nodes that stay."""
        rank = {NodeStatus.FAILURE: 0, NodeStatus.PENDING: 1}
        by_preference = sorted(
            nodes, key=lambda n: (rank.get(NodeStatus(n.status), 2), -n.launch_time.timestamp())
        )
        surplus = len(nodes) - target
        for node in by_preference[:surplus]:
            events.move(
                session,
                node,
                NodeStatus.SHUTTING_DOWN,
                ids=self.ids,
                now=now,
                description=f"Node {node.id} is shutting down (scale-down).",
            )
        return by_preference[surplus:]

    def settle_status(
        self,
        session: Session,
        cluster: Cluster,
        now: datetime,
        *,
        converged: bool,
        running: int | None = None,
    ) -> Outcome:
        """Status follows convergence: a Creating or Updating cluster that converged is InService,
        and so are its groups. ``running``: its Running nodes, if the caller counted them."""
        if not (converged and cluster.status in _SETTLING):
            return Outcome()
        cluster.updated_time = now
        if running is None:
            running = sum(1 for n in cluster.nodes if n.status == NodeStatus.RUNNING)
        description = f"Cluster is InService with {running} nodes"
        if self.provisioner.uses_agents:
            description += f"; policy generation {cluster.generation} applied on every node"
        events.move(
            session, cluster, ClusterStatus.IN_SERVICE, ids=self.ids, now=now, description=f"{description}."
        )
        for group in cluster.instance_groups:
            events.move(session, group, GroupStatus.IN_SERVICE, ids=self.ids, now=now)
        return Outcome(changed=True)

    def _bring_up(
        self, session: Session, cluster: Cluster, node: Node, now: datetime, outcome: Outcome
    ) -> bool:
        """Move a node towards Running; return whether it is Running with the current policy."""
        if node.status == NodeStatus.FAILURE:
            return False
        if not self.provisioner.uses_agents:
            if node.status in _COMING_UP:
                if node.pending_action is None and self.provisioner.is_ready(node, now):
                    self._running(session, cluster, node, now)
                    outcome.changed = True
                else:
                    outcome.note_due(node.ready_at)
                    return False
            return True
        current = node.registered_at is not None and node.acked_generation >= cluster.generation
        if node.status in _COMING_UP and current:
            self._running(session, cluster, node, now)
            outcome.changed = True
        return node.status == NodeStatus.RUNNING and current

    def _behind(self, cluster: Cluster, node: Node) -> bool:
        """Whether the node is Running, its agent registered, with an older policy generation than
        the cluster's: what a push brings up to date."""
        return (
            self.provisioner.uses_agents
            and node.status == NodeStatus.RUNNING
            and node.registered_at is not None
            and node.acked_generation < cluster.generation
        )

    def _running(self, session: Session, cluster: Cluster, node: Node, now: datetime) -> None:
        """A Pending node (or one attaching after MoveClusterNodes) is Running."""
        description = None
        if self.provisioner.uses_agents:
            description = f"Node {node.id} is Running (policy generation {cluster.generation})."
        if node.status == NodeStatus.ATTACH_IN_PROGRESS:
            description = f"Node {node.id} is Running in group {node.group_name} (MoveClusterNodes)" + (
                f"; policy generation {cluster.generation}." if self.provisioner.uses_agents else "."
            )
            node.move = None
            node.status_message = None
        events.move(
            session, node, NodeStatus.RUNNING, ids=self.ids, now=now, cluster=cluster, description=description
        )

    def _started_again_and_silent(self, node: Node) -> bool:
        """Whether this control plane started the node's agent again at its start and has not
        heard from it since."""
        last = node.last_heartbeat
        return node.id in self._started_again and (last is None or last < self._up_since)

    def _back_since(self) -> datetime:
        """Since when the control plane could hear its agents: silence before does not count
        against a node. The later of the database's last failure or stall (heartbeats were refused
        or could not be recorded; now while a statement waits for its answer) and this control
        plane's start (nobody was there to hear before). On this reconciler's clock: the database
        says how long ago, never when by the wall clock, which an injected clock (a test's) does
        not follow."""
        ago = self.db.unavailable_ago()
        if ago is None:
            return self._up_since
        return max(self.clock.now() - timedelta(seconds=ago), self._up_since)

    def _new_node(
        self, session: Session, cluster: Cluster, group: InstanceGroup, now: datetime, outcome: Outcome
    ) -> Node:
        """A Pending node in ``group``; its agent starts once the transaction has committed."""
        node = new_node(
            session,
            cluster,
            group,
            now,
            ids=self.ids,
            ready_delay_s=self.config.node_ready_delay_s,
            addresses=self.config.addresses,
        )
        if self.provisioner.uses_agents:
            outcome.launches.append(node.id)
        return node

    # ------------------------------------------------------------------ agents

    def _adopt_agents(self) -> None:
        """At start: every live node should have an agent. Those that a killed control plane left
        running are adopted as they are; the others (stopped by the last control plane's shutdown,
        or gone with a reboot) are started again on their nodes: same node id, same shared memory
        directory, where each finds the shards it held (README, "What a restart keeps"). The agent
        of a node being moved away (DetachInProgress) is adopted if it still runs (it is draining:
        the move waits for it to exit), never started again."""
        self._adopted = True
        if not self.provisioner.uses_agents:
            return
        with self.db.read() as session:
            nodes = session.scalars(
                select(Node)
                .where(Node.status.in_([*_COMING_UP, NodeStatus.RUNNING, NodeStatus.DETACH_IN_PROGRESS]))
                .options(selectinload(Node.cluster))
            ).all()
            # A node whose agent never registered may have an agent whose launch secret was never
            # committed (the last control plane was killed between starting it and its commit):
            # such agents are started again, with a secret of this control plane's.
            unregistered = {
                node.id for node in nodes if node.status in _COMING_UP and node.token_hash is None
            }
            running = self.provisioner.adopt_agents(live=[n.id for n in nodes], unregistered=unregistered)
            if running is None:
                return  # agents started elsewhere come back by themselves
            # A node lost to a NodeLoss fault stays lost (the heartbeat timeout fails it), as when
            # its agent crashes (_restart_crashed_agents).
            lost = {node_id for node in nodes for node_id in faults.lost_nodes(node.cluster)}
            # A node whose last start failed is started when its backoff is over (retry_starts).
            nodes = [
                node
                for node in nodes
                if node.id not in lost
                and (node.status != NodeStatus.DETACH_IN_PROGRESS or node.id in running)
                and (node.next_start_at is None or node.id in running)
            ]
            what = {node.id: "adopted" if node.id in running else "started again" for node in nodes}
            by_cluster: dict[str, list[str]] = {}
            for node in nodes:
                if node.id not in running:
                    by_cluster.setdefault(node.cluster_id, []).append(node.id)
        if what:
            self._record_start_or_stop(what, _started)
        for cluster_id, node_ids in by_cluster.items():
            self._started_again.update(node_ids)
            self._launch_agents(cluster_id, node_ids)

    def _record_start_or_stop(self, what: dict[str, str], describe: Callable[[Counter[str]], str]) -> None:
        """One event per cluster for the control plane's start or stop: ``what`` maps node ids to
        what happened to their agent; ``describe`` words a cluster's counts of each."""
        try:
            with self.db.write() as session:
                now = self.clock.now()
                nodes = session.scalars(select(Node).where(Node.id.in_(list(what)))).all()
                for cluster_id in sorted({n.cluster_id for n in nodes}):
                    cluster = session.get(Cluster, cluster_id)
                    if cluster is not None:
                        counts = Counter(what[n.id] for n in nodes if n.cluster_id == cluster_id)
                        events.record(
                            session, ids=self.ids, now=now, cluster=cluster, description=describe(counts)
                        )
        except OperationalError as exc:  # the database is down: the event is lost, nothing else
            log.warning("could not record the control plane's start or stop: %s", exc.orig)

    def _launch_agents(self, cluster_id: str, node_ids: list[str]) -> None:
        """Start agents for committed nodes; a node whose agent cannot start is tried again after a
        backoff, and fails after the last attempt (hyperpod_sim/domain/nodes/recovery.py). When the
        transaction fails (the database does not answer), the agents it started hold launch secrets
        that were never committed and could never register: they are stopped at once, and started
        again by the next pass that gets through (never a Running node whose agent cannot get in)."""
        node_ids = list(dict.fromkeys([*self._unlaunched.pop(cluster_id, ()), *node_ids]))
        started: list[str] = []
        try:
            with self.db.write() as session:
                # Locked: an agent's registration (which locks it too) waits for its launch secret.
                cluster = session.get(Cluster, cluster_id, with_for_update=True)
                if cluster is None:
                    return
                now = self.clock.now()
                lost = faults.lost_nodes(cluster)
                for node in session.scalars(select(Node).where(Node.id.in_(node_ids))):
                    if node.status in (NodeStatus.FAILURE, *LEAVING) or node.id in lost:
                        continue  # failed, leaving or lost since the pass that asked for it
                    try:
                        if self.provisioner.launch(cluster, node):
                            started.append(node.id)
                    except OSError as exc:
                        recovery.start_failed(
                            session,
                            cluster,
                            node,
                            now,
                            f"its agent could not be started: {exc}",
                            ids=self.ids,
                            attempts=self.config.start_attempts,
                        )
                    else:
                        recovery.started(node)
        except OperationalError:
            for node_id in started:
                self.provisioner.unlaunch(node_id)
            self._unlaunched[cluster_id] = set(node_ids)
            raise


def _agents_of(count: int) -> str:
    return "the agent of 1 node" if count == 1 else f"the agents of {count} nodes"


def _were(count: int) -> str:
    """The verb that agrees with ``_agents_of(count)``."""
    return "was" if count == 1 else "were"


def _started(counts: Counter[str]) -> str:
    parts = []
    if counts["adopted"]:
        adopted = counts["adopted"]
        parts.append(f"{_agents_of(adopted)} kept running and {_were(adopted)} adopted")
    if counts["started again"]:
        again = counts["started again"]
        parts.append(
            f"{_agents_of(again)} {_were(again)} started again on their nodes (same node ids, "
            "same shared-memory directories)"
        )
    return f"The control plane started: {'; '.join(parts)}."


def _stopping(counts: Counter[str]) -> str:
    return (
        f"The control plane is stopping: it stopped {_agents_of(counts['stopped'])}, each after "
        "persisting its newest complete step to S3; their shared memory is kept and they start "
        "again with the control plane."
    )


# A node on its way to Running: a new or rebooted one, or one moved in (MoveClusterNodes).
_COMING_UP = (NodeStatus.PENDING, NodeStatus.ATTACH_IN_PROGRESS)
# The statuses a cluster leaves for InService once it converged.
_SETTLING = (ClusterStatus.CREATING, ClusterStatus.UPDATING)


@dataclass(frozen=True)
class Rollout:
    """What a pass saw of a cluster that only waited for its nodes behind: its generation, status
    and number of nodes (every one Running, or it would not have converged)."""

    generation: int
    status: ClusterStatus
    nodes: int

    @property
    def seen(self) -> tuple[int, str]:
        return self.generation, self.status


def _caught_up(outcome: Outcome, results: list[PushResult], generation: int) -> bool:
    """Whether every node the pass found behind was pushed and applied ``generation``."""
    applied = {r.node_id for r in results if r.applied is not None and r.applied >= generation}
    return outcome.behind <= applied


def _members(cluster: Cluster) -> set[str]:
    """The nodes of the replica ring: every one not on its way out (shutting down, moving away)."""
    return {n.id for n in cluster.nodes if n.status not in LEAVING}


def _live_by_group(cluster: Cluster) -> dict[str, list[Node]]:
    """Each group's nodes that are not on their way out (shutting down or moving away: those count
    towards no group)."""
    live: dict[str, list[Node]] = {}
    for node in cluster.nodes:
        if node.status not in LEAVING:
            live.setdefault(node.group_name, []).append(node)
    return live
