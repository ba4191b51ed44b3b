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

import http.client
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import delete, or_, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, selectinload

from contracts.agent_api import CONTROL_PLANE_AGENT, POLICY_PATH
from contracts.policy import NodePolicy
from domain import credentials, events, faults
from domain.checkpoint_policy import S3Endpoint
from domain.clock import Clock, Ids
from domain.events import Level
from domain.lifecycle import ClusterStatus, GroupStatus, NodeStatus, check_transition
from domain.policy import build_policy
from domain.provisioning import Provisioner
from models import Cluster, Database, InstanceGroup, Node, Tag

log = logging.getLogger(__name__)

LIVE = (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.FAILURE)
# A crashed agent is restarted at once; one that crashes again within RESTART_WINDOW_S of its last
# restart waits RESTART_BACKOFF_S, doubling with each such restart up to RESTART_BACKOFF_MAX_S.
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


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


@dataclass(frozen=True)
class Push:
    """One policy push, claimed in a transaction and sent after it."""

    node_id: str
    endpoint: str
    token: str  # the node's control-plane token: only this control plane and that agent know it
    policy: NodePolicy


@dataclass(frozen=True)
class PushResult:
    node_id: str
    generation: int
    applied: int | None  # the generation the agent reports, or None on failure
    error: str | None = None
    permanent: bool = False
    # The generation an agent that answered "stale" (409) says it has: never an acknowledgement.
    # Ahead of every generation this control plane issued, it is a policy it did not get from
    # here, and the node is pushed again with a reset.
    ahead: int | None = None
    reset: bool = False  # the answer to a push with a reset


@dataclass
class Outcome:
    """What one reconcile pass over one cluster did."""

    changed: bool = False
    # Another pass right away can make progress (nodes to remove, pushes answered, ...).
    again: bool = False
    # The earliest time something is due (a launch delay, a push retry, a heartbeat deadline).
    due: datetime | None = None
    launches: list[str] = field(default_factory=list)
    pushes: list[Push] = field(default_factory=list)
    # Nodes whose crashed agent waits out its restart backoff: not failed for missed heartbeats.
    restart_pending: set[str] = field(default_factory=set)

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
        self._pool: ThreadPoolExecutor | None = None
        self._adopted = False
        # When this control plane came up: no node is failed for the silence before (its agent
        # could not reach a control plane that was down), as none is for a database outage's.
        self._up_since = clock.now()
        # Nodes whose agent this control plane started again at its start (README, "What a restart
        # keeps"): each has as long to register as a new node's.
        self._started_again: set[str] = set()
        self._stopped = False

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        self._up_since = self.clock.now()
        if self.provisioner.uses_agents:
            self._pool = ThreadPoolExecutor(
                max_workers=self.config.push_workers, thread_name_prefix="policy-push"
            )
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
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
            timeout = self.config.interval_s
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
                Node.status.in_([NodeStatus.PENDING, NodeStatus.SHUTTING_DOWN])
            )
            query = query.where(
                or_(
                    Cluster.status.in_(
                        [ClusterStatus.CREATING, ClusterStatus.UPDATING, ClusterStatus.DELETING]
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
        for cluster_id in self.pending_cluster_ids():
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
        if outcome.launches:
            self._launch_agents(cluster_id, outcome.launches)
            outcome.again = outcome.changed = True
        if outcome.pushes:
            resets = self._record_pushes(cluster_id, self._send(outcome.pushes))
            if resets:
                again = [push for push in outcome.pushes if push.node_id in resets]
                self._record_pushes(cluster_id, self._send(again, reset=True))
            outcome.again = outcome.changed = True
        return outcome

    def _step(self, session: Session, cluster: Cluster, outcome: Outcome) -> None:
        now = self.clock.now()
        # 1. Nodes that are shutting down go away once their agent has stopped. An agent told to
        # stop drains its unpersisted checkpoints to S3 first, calling the control plane as it
        # does (namespaces, events): so the node's row, and a deleted cluster's, stay until then.
        # The provisioner bounds the wait (SIGKILL after its grace period).
        for node in list(cluster.nodes):
            if node.status == NodeStatus.SHUTTING_DOWN:
                self.provisioner.terminate(node)
                if not self.provisioner.has_stopped(node):
                    continue  # looked at again on the next tick
                cluster.nodes.remove(node)
                session.delete(node)
                outcome.changed = True

        if cluster.status == ClusterStatus.DELETING:
            for node in cluster.nodes:
                if node.status != NodeStatus.SHUTTING_DOWN:
                    node.status = NodeStatus.SHUTTING_DOWN
                    outcome.changed = outcome.again = True
            if not cluster.nodes:
                session.execute(delete(Tag).where(Tag.resource_arn == cluster.arn))
                session.delete(cluster)
                outcome.changed = True
            return

        changed, due = faults.end_due_faults(
            session, ids=self.ids, now=now, cluster=cluster, provisioner=self.provisioner
        )
        if changed:
            outcome.changed = True
        if due is not None:
            outcome.note_due(due)
        if self.provisioner.uses_agents:
            self._restart_crashed_agents(session, cluster, now, outcome)
            self._detect_failures(session, cluster, now, outcome)

        members_before = {n.id for n in cluster.nodes if n.status != NodeStatus.SHUTTING_DOWN}
        live_by_group: dict[str, list[Node]] = {}
        for node in cluster.nodes:
            if node.status != NodeStatus.SHUTTING_DOWN:  # on its way out: not part of any group
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
        # no launch delay a simulated cluster goes Creating -> InService in one transaction.
        converged = True
        for group in cluster.instance_groups:
            if group.status == GroupStatus.DELETING:
                converged = False
                continue
            nodes = live_by_group.get(group.name, [])
            if len(nodes) < group.target_count:
                launched = [
                    self._new_node(session, cluster, group, now, outcome)
                    for _ in range(group.target_count - len(nodes))
                ]
                nodes = nodes + launched
                outcome.changed = True
            elif len(nodes) > group.target_count:
                # Scale down: failed nodes first, then pending ones, then the newest.
                rank = {NodeStatus.FAILURE: 0, NodeStatus.PENDING: 1}
                by_preference = sorted(
                    nodes, key=lambda n: (rank.get(NodeStatus(n.status), 2), -n.launch_time.timestamp())
                )
                surplus = len(nodes) - group.target_count
                for node in by_preference[:surplus]:
                    node.status = NodeStatus.SHUTTING_DOWN
                    events.record(
                        session,
                        ids=self.ids,
                        now=now,
                        cluster=cluster,
                        node=node,
                        description=f"Node {node.id} is shutting down (scale-down).",
                    )
                nodes = by_preference[surplus:]
                outcome.changed = True
                converged = False
            for node in nodes:
                converged &= self._bring_up(session, cluster, node, now, outcome)
        if any(n.status == NodeStatus.SHUTTING_DOWN for n in cluster.nodes):
            converged = False
            outcome.again = True

        # The node set changed outside an update (a scale step after BatchDeleteClusterNodes, ...):
        # the replica ring changed, so every node needs a new policy generation.
        members_after = {n.id for n in cluster.nodes if n.status != NodeStatus.SHUTTING_DOWN}
        if members_after != members_before and cluster.status == ClusterStatus.IN_SERVICE:
            cluster.generation += 1

        if self.provisioner.uses_agents:
            self._claim_pushes(cluster, now, outcome)

        # 4. Status follows convergence.
        if converged and cluster.status in (ClusterStatus.CREATING, ClusterStatus.UPDATING):
            cluster.status = check_transition(cluster.status, ClusterStatus.IN_SERVICE)
            cluster.updated_time = now
            for group in cluster.instance_groups:
                group.status = GroupStatus.IN_SERVICE
            running = sum(1 for n in cluster.nodes if n.status == NodeStatus.RUNNING)
            description = f"Cluster is InService with {running} nodes"
            if self.provisioner.uses_agents:
                description += f"; policy generation {cluster.generation} applied on every node"
            events.record(session, ids=self.ids, now=now, cluster=cluster, description=description + ".")
            outcome.changed = True

    def _bring_up(
        self, session: Session, cluster: Cluster, node: Node, now: datetime, outcome: Outcome
    ) -> bool:
        """Move a node towards Running; return whether it is Running with the current policy."""
        if node.status == NodeStatus.FAILURE:
            return False
        if not self.provisioner.uses_agents:
            if node.status == NodeStatus.PENDING:
                if self.provisioner.is_ready(node, now):
                    node.status = NodeStatus.RUNNING
                    outcome.changed = True
                else:
                    outcome.note_due(node.ready_at)
                    return False
            return True
        current = node.registered_at is not None and node.acked_generation >= cluster.generation
        if node.status == NodeStatus.PENDING and current:
            node.status = NodeStatus.RUNNING
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                node=node,
                description=f"Node {node.id} is Running (policy generation {cluster.generation}).",
            )
            outcome.changed = True
        return node.status == NodeStatus.RUNNING and current

    def _detect_failures(self, session: Session, cluster: Cluster, now: datetime, outcome: Outcome) -> None:
        heartbeat_timeout = timedelta(seconds=self.config.heartbeat_timeout_s)
        launch_timeout = timedelta(seconds=self.config.launch_timeout_s)
        # Silence while the control plane could not hear does not count against a node: it has a
        # whole timeout from the database's last failure (heartbeats refused; the epoch when it
        # never failed) and from this control plane's start (heartbeats nobody was there to hear).
        back = max(datetime.fromtimestamp(self.db.last_unavailable_at, tz=UTC), self._up_since)
        replaced = False
        for node in list(cluster.nodes):
            reason = None
            if node.status in (NodeStatus.PENDING, NodeStatus.RUNNING):
                restarted = node.agent_restarted_at
                last_heartbeat = node.last_heartbeat
                if node.id in outcome.restart_pending:
                    # The control plane is restarting its agent (a kubelet's CrashLoopBackOff): the
                    # node stays up through the backoff; the restarted agent then has the launch
                    # timeout to register (below).
                    pass
                elif last_heartbeat is not None and (
                    (restarted is not None and restarted >= last_heartbeat)
                    or self._started_again_and_silent(node)
                ):
                    # A restarted agent (after a crash, or with the control plane) has as long to
                    # register as a new one, counted from the last heartbeat: an agent that keeps
                    # crashing does not keep its node alive.
                    deadline = max(last_heartbeat, back) + heartbeat_timeout + launch_timeout
                    if now >= deadline:
                        why = "crashed and was restarted"
                        if self._started_again_and_silent(node):
                            why = "was started again with the control plane"
                        reason = (
                            f"its agent {why}, but did not register within {self.config.launch_timeout_s:g} s"
                        )
                    else:
                        outcome.note_due(deadline)
                elif last_heartbeat is not None:
                    deadline = max(last_heartbeat, back) + heartbeat_timeout
                    if now >= deadline:
                        reason = f"no heartbeat from its agent for {self.config.heartbeat_timeout_s:g} s"
                    else:
                        outcome.note_due(deadline)
                else:
                    deadline = max(node.launch_time, back) + launch_timeout
                    if now >= deadline:
                        reason = f"its agent did not register within {self.config.launch_timeout_s:g} s"
                    else:
                        outcome.note_due(deadline)
            if reason is not None:
                self._fail(session, cluster, node, now, reason)
                outcome.changed = True
            if node.status == NodeStatus.FAILURE and cluster.node_recovery == "Automatic":
                group = next((g for g in cluster.instance_groups if g.name == node.group_name), None)
                node.status = NodeStatus.SHUTTING_DOWN
                # Its credentials die with it: the replacement registers with a secret of its own.
                credentials.revoke(node)
                if group is not None and group.status != GroupStatus.DELETING:
                    replacement = self._new_node(session, cluster, group, now, outcome, slot=node.slot)
                    events.record(
                        session,
                        ids=self.ids,
                        now=now,
                        cluster=cluster,
                        node=node,
                        level=Level.WARN,
                        description=(
                            f"Node {node.id} is replaced by {replacement.id} (NodeRecovery: Automatic)."
                        ),
                    )
                replaced = True
                outcome.changed = outcome.again = True
        if replaced:
            cluster.generation += 1  # the ring changed: every node's replica peers may have

    def _started_again_and_silent(self, node: Node) -> bool:
        """Whether this control plane started the node's agent again at its start and has not
        heard from it since."""
        last = node.last_heartbeat
        return node.id in self._started_again and (last is None or last < self._up_since)

    def _restart_crashed_agents(
        self, session: Session, cluster: Cluster, now: datetime, outcome: Outcome
    ) -> None:
        """Start again the agent of a Pending or Running node whose agent process has gone (it
        registered before, so it did not just fail to start), unless the node was lost (a NodeLoss
        fault): the node keeps its id and its shared memory, and the agent finds its shards there."""
        if not self.config.restart_agents:
            return
        running = self.provisioner.running_agents()
        if running is None:
            return
        lost = faults.lost_nodes(cluster)
        for node in cluster.nodes:
            if (
                node.status not in (NodeStatus.PENDING, NodeStatus.RUNNING)
                or node.endpoint is None
                or node.id in running
                or node.id in lost
            ):
                continue
            last = node.agent_restarted_at
            restarts = 1
            if last is not None and now - last < timedelta(seconds=RESTART_WINDOW_S):
                delay = timedelta(
                    seconds=min(RESTART_BACKOFF_S * 2 ** (node.agent_restarts - 1), RESTART_BACKOFF_MAX_S)
                )
                if now < last + delay:
                    outcome.note_due(last + delay)
                    outcome.restart_pending.add(node.id)
                    continue
                restarts = node.agent_restarts + 1
            node.agent_restarts = restarts
            node.agent_restarted_at = now
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                node=node,
                level=Level.WARN,
                description=f"The agent of node {node.id} exited unexpectedly; restarting it "
                f"(restart {restarts} in a row).",
            )
            outcome.launches.append(node.id)
            outcome.changed = True

    def _fail(self, session: Session, cluster: Cluster, node: Node, now: datetime, reason: str) -> None:
        """Mark a node failed, with the reason in its status and an Error event."""
        node.status = NodeStatus.FAILURE
        node.status_message = f"Node failed: {reason}."
        events.record(
            session,
            ids=self.ids,
            now=now,
            cluster=cluster,
            node=node,
            level=Level.ERROR,
            description=f"Node {node.id} failed: {reason}.",
        )

    def _new_node(
        self,
        session: Session,
        cluster: Cluster,
        group: InstanceGroup,
        now: datetime,
        outcome: Outcome,
        *,
        slot: int | None = None,
    ) -> Node:
        """A Pending node in ``group`` (in ``slot``, or the lowest free one); its agent starts once
        the transaction has committed."""
        if slot is None:
            taken = {
                n.slot
                for n in cluster.nodes
                if n.group_name == group.name and n.status != NodeStatus.SHUTTING_DOWN
            }
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
        node_id = self.ids.node_id()
        node = Node(
            slot=slot,
            id=node_id,
            cluster_id=cluster.id,
            group_name=group.name,
            logical_id=f"{group.name}-{node_id[2:]}",
            instance_type=group.instance_type,
            status=NodeStatus.PENDING,
            status_message=None,
            launch_time=now,
            ready_at=now + timedelta(seconds=self.config.node_ready_delay_s),
            private_ip=self.ids.private_ip(),
            acked_generation=0,
            push_attempts=0,
        )
        cluster.nodes.append(node)
        events.record(
            session,
            ids=self.ids,
            now=now,
            cluster=cluster,
            node=node,
            description=f"Node {node.id} launched in group {group.name}.",
        )
        if self.provisioner.uses_agents:
            outcome.launches.append(node.id)
        return node

    # ------------------------------------------------------------------ agents

    def _adopt_agents(self) -> None:
        """At start: every live node should have an agent. Those that a killed control plane left
        running are adopted as they are; the others (stopped by the last control plane's shutdown,
        or gone with a reboot) are started again on their nodes: same node id, same shared memory
        directory, where each finds the shards it held (README, "What a restart keeps")."""
        self._adopted = True
        if not self.provisioner.uses_agents:
            return
        with self.db.read() as session:
            nodes = session.scalars(
                select(Node)
                .where(Node.status.in_([NodeStatus.PENDING, NodeStatus.RUNNING]))
                .options(selectinload(Node.cluster))
            ).all()
            # A node whose agent never registered may have an agent whose launch secret was never
            # committed (the last control plane was killed between starting it and its commit):
            # such agents are started again, with a secret of this control plane's.
            unregistered = {
                node.id for node in nodes if node.status == NodeStatus.PENDING and node.token_hash is None
            }
            running = self.provisioner.adopt_agents(unregistered=unregistered)
            if running is None:
                return  # agents started elsewhere come back by themselves
            # A node lost to a NodeLoss fault stays lost (the heartbeat timeout fails it), as when
            # its agent crashes (_restart_crashed_agents).
            lost = {node_id for node in nodes for node_id in faults.lost_nodes(node.cluster)}
            nodes = [node for node in nodes if node.id not in lost]
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
        """Start agents for committed nodes; a node whose agent cannot start fails."""
        with self.db.write() as session:
            # Locked: an agent's registration (which locks it too) waits for its launch secret.
            cluster = session.get(Cluster, cluster_id, with_for_update=True)
            if cluster is None:
                return
            now = self.clock.now()
            for node in session.scalars(select(Node).where(Node.id.in_(node_ids))):
                try:
                    self.provisioner.launch(cluster, node)
                except OSError as exc:
                    self._fail(session, cluster, node, now, f"its agent could not start: {exc}")

    def _claim_pushes(self, cluster: Cluster, now: datetime, outcome: Outcome) -> None:
        members = [n for n in cluster.nodes if n.status in LIVE]
        lease = timedelta(seconds=self.config.push_timeout_s * 2)
        for node in cluster.nodes:
            if (
                node.status not in (NodeStatus.PENDING, NodeStatus.RUNNING)
                or node.endpoint is None
                or node.push_token is None  # no agent registered with this control plane's tokens
                or node.acked_generation >= cluster.generation
            ):
                continue
            if node.push_claimed_until is not None and node.push_claimed_until > now:
                outcome.note_due(node.push_claimed_until)
                continue  # another control plane (or an earlier pass) is pushing it
            if node.next_push_at is not None and node.next_push_at > now:
                outcome.note_due(node.next_push_at)
                continue
            node.push_claimed_until = now + lease
            policy = build_policy(
                cluster,
                node,
                members,
                memory_scale=self.config.memory_scale,
                s3_endpoint=self.config.s3_endpoint,
            )
            outcome.pushes.append(Push(node.id, node.endpoint, node.push_token, policy))

    def _put_policy(self, push: Push, *, reset: bool) -> tuple[int, str]:
        """One PUT /v1/policy over a plain http.client connection: at 64 nodes a rollout is mostly
        pushes, and a pooled httpx client cost several times the CPU per request
        (bench/policy_rollout.py). The answer's status and text; transport errors are raised."""
        url = urlsplit(push.endpoint)
        connection = http.client.HTTPConnection(
            url.hostname or "127.0.0.1", url.port or 80, timeout=self.config.push_timeout_s
        )
        try:
            connection.request(
                "PUT",
                f"{POLICY_PATH}?reset=true" if reset else POLICY_PATH,
                body=json.dumps(push.policy.document()).encode(),
                headers={
                    "Authorization": f"Bearer {push.token}",
                    "Content-Type": "application/json",
                    "User-Agent": CONTROL_PLANE_AGENT,
                },
            )
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            connection.close()

    def _push_one(self, push: Push, *, reset: bool = False) -> PushResult:
        """Push a node's policy; with ``reset``, one the agent takes even though it is older than
        the one it has (the control plane's token is the authority). Never raises: whatever goes
        wrong (a connect error, an endpoint it cannot even parse) is this node's error only."""
        generation = push.policy.generation
        try:
            status, text = self._put_policy(push, reset=reset)
        except Exception as exc:
            return PushResult(push.node_id, generation, None, f"{type(exc).__name__}: {exc}", reset=reset)
        applied = _applied_generation(text)
        if status == 200 and applied is not None:
            return PushResult(push.node_id, generation, applied, reset=reset)
        error = f"HTTP {status}: {text[:200]}"
        if status == 409 and applied is not None and applied > generation and not reset:
            error = f"the agent answered that it has generation {applied}, newer than {generation}"
            return PushResult(push.node_id, generation, None, error, ahead=applied)
        permanent = status == 200 or 400 <= status < 500  # a 200 off the contract too
        return PushResult(push.node_id, generation, None, error, permanent, reset=reset)

    def _send(self, pushes: list[Push], *, reset: bool = False) -> list[PushResult]:
        assert self._pool is not None
        return list(self._pool.map(lambda push: self._push_one(push, reset=reset), pushes))

    def _record_pushes(self, cluster_id: str, results: list[PushResult]) -> set[str]:
        """Record what the agents answered; the nodes to push again with a reset (their agents are
        ahead of every generation this control plane issued)."""
        now = self.clock.now()
        resets: set[str] = set()
        with self.db.write() as session:
            cluster = session.get(Cluster, cluster_id)
            nodes = {
                n.id: n
                for n in session.scalars(select(Node).where(Node.id.in_([r.node_id for r in results])))
            }
            for result in results:
                node = nodes.get(result.node_id)
                if node is None:
                    continue
                node.push_claimed_until = None
                if result.ahead is not None and cluster is not None:
                    if result.ahead <= cluster.generation:
                        # A newer generation of ours (another control plane pushed it first).
                        result = replace(result, applied=result.generation)
                    else:
                        events.record(
                            session,
                            ids=self.ids,
                            now=now,
                            cluster=cluster,
                            node=node,
                            level=Level.WARN,
                            description=f"The agent of node {node.id} reported policy generation "
                            f"{result.ahead}, ahead of this control plane's {cluster.generation}: a "
                            "policy it did not get from the control plane. Re-syncing it to generation "
                            f"{result.generation}.",
                        )
                        node.push_claimed_until = now + timedelta(seconds=self.config.push_timeout_s * 2)
                        resets.add(node.id)
                        continue
                if result.applied is not None:
                    node.acked_generation = max(node.acked_generation, min(result.applied, result.generation))
                    node.push_attempts = 0
                    node.next_push_at = None
                    node.last_error = None
                    continue
                node.push_attempts += 1
                if result.permanent:
                    delay = self.config.push_backoff_max_s
                else:
                    delay = min(
                        self.config.push_backoff_s * 2 ** (node.push_attempts - 1),
                        self.config.push_backoff_max_s,
                    )
                node.next_push_at = now + timedelta(seconds=delay)
                node.last_error = f"policy push of generation {result.generation} failed: {result.error}"
                log.info("push to %s failed (attempt %d): %s", node.id, node.push_attempts, result.error)
        return resets


def _agents_of(count: int) -> str:
    return "the agent of 1 node" if count == 1 else f"the agents of {count} nodes"


def _started(counts: Counter[str]) -> str:
    parts = []
    if counts["adopted"]:
        parts.append(f"{_agents_of(counts['adopted'])} kept running and were adopted")
    if counts["started again"]:
        parts.append(
            f"{_agents_of(counts['started again'])} were started again on their nodes (same node ids, "
            "same shared-memory directories)"
        )
    return f"The control plane started: {'; '.join(parts)}."


def _stopping(counts: Counter[str]) -> str:
    return (
        f"The control plane is stopping: it stopped {_agents_of(counts['stopped'])}, each after "
        "persisting its newest complete step to S3; their shared memory is kept and they start "
        "again with the control plane."
    )


def _applied_generation(text: str) -> int | None:
    """``applied_generation`` of an agent's answer, or None if it has none."""
    try:
        value = json.loads(text)["applied_generation"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
