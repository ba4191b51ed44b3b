"""The control plane's side of the agent protocol: registration, heartbeats, policy pulls, events.

See docs/agent-protocol.md. Who may register which node: an agent the local provisioner started,
with its node's launch secret; with the external provisioner, any agent with the bootstrap token,
bound to a pending node slot nobody else holds. Every other call carries the node token that
registration answered (domain/nodes/credentials.py): it authenticates that one node, so an agent cannot
heartbeat, pull or report events for another node. A missing token is 401, a wrong one 403.

A caller without a valid token learns nothing about which clusters exist: a missing and an
existing cluster answer alike (401 without a token, 403 with a wrong one, 404 ``NodeNotFound`` for
a node it names), since these routes are open to anyone who reaches the port.
"""

from __future__ import annotations

import hmac
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.sql import ColumnElement

from hyperpod_sim.contracts.agent_bodies import S3TierStatus
from hyperpod_sim.contracts.limits import (
    DEFAULT_MAX_NAMESPACE_RANKS,
    DEFAULT_MAX_NAMESPACES_PER_CLUSTER,
    MAX_EVENT_MESSAGE,
    namespace_name_problem,
    num_ranks_problem,
)
from hyperpod_sim.domain import events
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy, S3Endpoint
from hyperpod_sim.domain.checkpoints.node_policy import RingRow, build_policy, ring
from hyperpod_sim.domain.checkpoints.pushes import push_coming
from hyperpod_sim.domain.errors import AgentProtocolError
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LEAVING, LIVE, NodeStatus
from hyperpod_sim.domain.nodes import credentials, recovery
from hyperpod_sim.domain.nodes.agent_inputs import check_endpoint, check_s3_status, endpoint_address
from hyperpod_sim.domain.nodes.pacing import HeartbeatPacing
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import CheckpointNamespace, Cluster, Node


@dataclass(frozen=True)
class AgentConfig:
    pacing: HeartbeatPacing  # each agent's heartbeat interval, answered at registration and heartbeats
    memory_scale: float
    s3_endpoint: S3Endpoint
    # The control plane starts every node's agent itself (local provisioner): those register with
    # their launch secret only, the bootstrap token registers nothing, endpoints are loopback.
    local_agents: bool = False
    # The namespaces node network's subnet: where local agents listen besides loopback.
    node_subnet: str | None = None
    # Limits of the in-memory tier's namespaces (HPSIM_LIMITS__*, docs/memory-tier.md "Limits").
    max_namespaces_per_cluster: int = DEFAULT_MAX_NAMESPACES_PER_CLUSTER
    max_namespace_ranks: int = DEFAULT_MAX_NAMESPACE_RANKS


def check_token(presented: str | None, expected: str) -> None:
    if not presented:
        raise _missing_token("bootstrap token")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise _not_the_bootstrap_token()


def _missing_token(what: str) -> AgentProtocolError:
    return AgentProtocolError(401, "MissingToken", f"Authorization: Bearer <{what}> is required.")


def _not_the_bootstrap_token() -> AgentProtocolError:
    return AgentProtocolError(403, "InvalidToken", "The token is not the bootstrap token of this cluster.")


def _not_a_node_token(cluster_name: str) -> AgentProtocolError:
    return AgentProtocolError(
        403, "InvalidToken", f"The token is not the node token of a node of cluster '{cluster_name}'."
    )


def _token_of(cluster_name: str, token: str) -> ColumnElement[bool]:
    """The node of cluster ``cluster_name`` whose node token is ``token`` (Node joined to Cluster)."""
    return and_(Cluster.name == cluster_name, Node.token_hash == credentials.digest(token))


class _HeartbeatRow(NamedTuple):
    """A node's columns that its heartbeat reads, with its cluster's generation: both the node and
    the cluster that ``push_coming`` asks about."""

    id: str
    status: str
    endpoint: str | None
    pid: int | None
    s3_status: S3TierStatus | None
    acked_generation: int
    launch_secret_hash: str | None
    push_token: str | None
    push_claimed_until: datetime | None
    next_push_at: datetime | None
    generation: int


# How long a request waits for the member list another thread is building before it reads the
# rows itself.
MEMBERS_WAIT_S = 30.0


@dataclass(eq=False)
class _Flight:
    """A member list being built: set ``done`` once ``answer`` is there (None: the build failed)."""

    done: threading.Event = field(default_factory=threading.Event)
    answer: dict[str, Any] | None = None


@dataclass(kw_only=True, eq=False)
class AgentService(DomainService):
    """The control plane's side of the agent protocol (registration, heartbeats, pulls, events)."""

    config: AgentConfig
    # The member list being built for each cluster, which requests that come meanwhile wait for.
    _members_flights: dict[str, _Flight] = field(default_factory=dict, init=False, repr=False)
    _members_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _cluster(session: Session, name: str, *, lock: bool = False, nodes: bool = False) -> Cluster:
        """The cluster ``name`` (``lock``: its row locked), with its node set loaded only when
        ``nodes``: agents call every few seconds each, and a 1,024-node cluster's rows cost a call
        tens of milliseconds that most calls do not need."""
        loads = [selectinload(Cluster.instance_groups)] + ([selectinload(Cluster.nodes)] if nodes else [])
        query = select(Cluster).where(Cluster.name == name).options(*loads)
        if lock:
            query = query.with_for_update()
        cluster = session.scalars(query).one_or_none()
        if cluster is None:
            raise AgentProtocolError(404, "ClusterNotFound", f"Cluster '{name}' does not exist.")
        return cluster

    @staticmethod
    def _node(session: Session, cluster: Cluster, node_id: str) -> Node:
        node = session.get(Node, node_id)
        if node is not None and node.cluster_id == cluster.id and node.status != NodeStatus.SHUTTING_DOWN:
            return node
        raise AgentProtocolError(
            404, "NodeNotFound", f"Node {node_id} is not a node of cluster '{cluster.name}'."
        )

    @staticmethod
    def _token_row(session: Session, cluster_name: str, token: str) -> tuple[Cluster, Node] | None:
        """The cluster and the node whose node token this is (one row, not the cluster's node set:
        every node calls every second, so this must not grow with the cluster)."""
        row = session.execute(
            select(Cluster, Node)
            .join(Node, Node.cluster_id == Cluster.id)
            .where(_token_of(cluster_name, token))
        ).one_or_none()
        return None if row is None else (row[0], row[1])

    @staticmethod
    def _heartbeat_row(session: Session, cluster_name: str, token: str) -> _HeartbeatRow | None:
        """What a heartbeat reads of the node whose node token this is, and its cluster's
        generation, as one row of columns."""
        row = session.execute(
            select(
                Node.id,
                Node.status,
                Node.endpoint,
                Node.pid,
                Node.s3_status,
                Node.acked_generation,
                Node.launch_secret_hash,
                Node.push_token,
                Node.push_claimed_until,
                Node.next_push_at,
                Cluster.generation,
            )
            .join(Cluster, Node.cluster_id == Cluster.id)
            .where(_token_of(cluster_name, token))
        ).one_or_none()
        return None if row is None else _HeartbeatRow(*row)

    def _authenticate(self, session: Session, cluster_name: str, token: str | None) -> tuple[Cluster, Node]:
        """The cluster and the node whose node token is presented (ShuttingDown nodes included:
        a draining agent still calls)."""
        if not token:
            raise _missing_token("node token")
        row = self._token_row(session, cluster_name, token)
        if row is None:  # a missing cluster has no node tokens: the same answer
            raise _not_a_node_token(cluster_name)
        return row

    def _own_node(
        self, session: Session, cluster_name: str, node_id: str, token: str | None
    ) -> tuple[Cluster, Node]:
        """The live node ``node_id`` of a node-scoped call (heartbeat, policy pull), authenticated
        by its own node token. A node that is gone or ShuttingDown answers 404 whatever the token:
        that is how the agent of a deleted or replaced node (its token revoked) learns to stop."""
        if not token:
            raise _missing_token("node token")
        row = self._token_row(session, cluster_name, token)
        if row is not None and row[1].id == node_id and row[1].status != NodeStatus.SHUTTING_DOWN:
            return row
        raise self._not_own_node(session, cluster_name, node_id, None if row is None else row[1].id)

    def _not_own_node(
        self, session: Session, cluster_name: str, node_id: str, token_node: str | None
    ) -> AgentProtocolError:
        """What a node-scoped call is refused when its token is not the live node's own:
        ``token_node`` is the node whose token it is (None: no node's of the cluster)."""
        status = session.execute(
            select(Node.status)
            .join(Cluster, Node.cluster_id == Cluster.id)
            .where(Cluster.name == cluster_name, Node.id == node_id)
        ).scalar_one_or_none()
        if status is None or status == NodeStatus.SHUTTING_DOWN:  # a missing cluster's nodes too
            return self._node_gone(cluster_name, node_id)
        if token_node is None:
            return _not_a_node_token(cluster_name)
        return AgentProtocolError(
            403,
            "WrongNode",
            f"The token is the node token of node {token_node}; it cannot act for node {node_id}.",
        )

    @staticmethod
    def _node_gone(cluster_name: str, node_id: str) -> AgentProtocolError:
        return AgentProtocolError(
            404, "NodeNotFound", f"Node {node_id} is not a node of cluster '{cluster_name}'."
        )

    @staticmethod
    def _ring_members(session: Session, cluster: Cluster, *, leaving: bool = False) -> list[RingRow]:
        """The cluster's live nodes (``leaving``: and those shutting down or moving away whose
        agent registered) in ring order, as light rows: what the ring and the members call need."""
        alive: ColumnElement[bool] = Node.status.in_(LIVE)
        if leaving:
            alive = or_(alive, and_(Node.status.in_(LEAVING), Node.endpoint.is_not(None)))
        rows = session.execute(
            select(Node.id, Node.group_name, Node.slot, Node.launch_time, Node.status, Node.endpoint).where(
                Node.cluster_id == cluster.id, alive
            )
        ).all()
        return ring(cluster, [RingRow(*row) for row in rows])

    def policy_for(self, session: Session, cluster: Cluster, node: Node) -> dict[str, Any]:
        members = self._ring_members(session, cluster)
        return build_policy(
            cluster,
            node,
            members,
            memory_scale=self.config.memory_scale,
            s3_endpoint=self.config.s3_endpoint,
        ).document()

    # ------------------------------------------------------------------ calls

    def register(
        self,
        *,
        cluster_name: str,
        token: str | None,
        node_id: str | None,
        endpoint: str,
        pid: int | None,
    ) -> dict[str, Any]:
        """Bind an agent to a node and answer its credentials and policy.

        With ``node_id``: the agent the local provisioner launched for that node, which presents
        the node's launch secret; nothing else can register a launched node. Without: an agent of
        the external provisioner, with the bootstrap token, bound to the oldest pending node slot
        that no agent holds. Either way the node gets a new node token and control-plane token (the
        ones of an earlier agent of the node stop working)."""
        endpoint = check_endpoint(
            endpoint, loopback_only=self.config.local_agents, node_subnet=self.config.node_subnet
        )
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster_or_refusal(session, cluster_name, token, node_id)
            if node_id is not None:
                node = self._launched_node(session, cluster, node_id, token)
            else:
                node = self._pending_slot(cluster, token)
            # Its agent registered before (a restart of the agent, not of the machine: a reboot
            # clears the endpoint); on the loopback network the endpoint stays the same.
            rebinding = node.endpoint is not None
            node_token, control_plane_token = credentials.issue_tokens(node)
            node.endpoint = endpoint
            if not self.config.local_agents:  # an agent started elsewhere brings its node's address
                node.address = endpoint_address(endpoint)
            node.pid = pid
            node.registered_at = now
            node.last_heartbeat = now
            node.push_attempts = 0
            node.next_push_at = None
            node.last_error = None
            if node.status == NodeStatus.FAILURE:
                events.move(session, node, NodeStatus.PENDING, ids=self.ids, now=now)
                node.status_message = None
            recovery.registered(node)
            events.node_event(
                session,
                node,
                f"Agent {'re-registered' if rebinding else 'registered'} at {endpoint}.",
                ids=self.ids,
                now=now,
            )
            answer = {
                "node_id": node.id,
                "node_token": node_token,
                "control_plane_token": control_plane_token,
                "cluster_token": cluster.token,
                "heartbeat_interval_s": self.config.pacing.interval(),
                "policy": self.policy_for(session, cluster, node),
            }
        self.on_change()
        return answer

    def _cluster_or_refusal(
        self, session: Session, cluster_name: str, token: str | None, node_id: str | None
    ) -> Cluster:
        """The cluster a registration is for, locked; for a missing one, the refusal that an
        existing cluster gives a caller without valid credentials (no token: 401; a node id: 404
        NodeNotFound, as an unknown node; else 403, as a wrong bootstrap token)."""
        try:
            # An external agent takes a pending slot: the node set is read for it.
            return self._cluster(session, cluster_name, lock=True, nodes=node_id is None)
        except AgentProtocolError:
            if not token:
                raise _missing_token(
                    "the node's launch secret" if node_id is not None else "bootstrap token"
                ) from None
            if node_id is not None:
                raise self._node_gone(cluster_name, node_id) from None
            raise _not_the_bootstrap_token() from None

    def _launched_node(self, session: Session, cluster: Cluster, node_id: str, token: str | None) -> Node:
        """The node the local provisioner launched an agent for, if ``token`` is its launch secret."""
        if not token:
            raise _missing_token("the node's launch secret")
        node = self._node(session, cluster, node_id)
        if not credentials.matches(token, node.launch_secret_hash):
            why = (
                "which this is not"
                if node.launch_secret_hash is not None
                else "and none is outstanding (it was used, or no agent was launched for it)"
            )
            raise AgentProtocolError(
                403,
                "InvalidNodeSecret",
                f"Node {node_id} registers only with the launch secret the control plane "
                f"handed to the agent it started for it, {why}.",
            )
        return node

    def _pending_slot(self, cluster: Cluster, token: str | None) -> Node:
        """The oldest pending node slot that no agent holds, for an external agent with the
        bootstrap token."""
        check_token(token, cluster.bootstrap_token)
        if self.config.local_agents:
            raise AgentProtocolError(
                403,
                "BootstrapNotAccepted",
                "This control plane starts the agent of every node itself (local provisioner); "
                "each registers with its own launch secret. The bootstrap token registers agents "
                "only with HPSIM_PROVISIONING__MODE=external.",
            )
        slots = sorted(
            (
                n
                for n in cluster.nodes
                if n.status in (NodeStatus.PENDING, NodeStatus.ATTACH_IN_PROGRESS)
                and n.endpoint is None
                and n.token_hash is None
                and n.launch_secret_hash is None
            ),
            key=lambda n: (n.launch_time, n.id),
        )
        if not slots:
            raise AgentProtocolError(
                409, "NoPendingSlot", f"Cluster '{cluster.name}' has no node waiting for an agent."
            )
        return slots[0]

    def heartbeat(
        self,
        *,
        cluster_name: str,
        node_id: str,
        token: str | None,
        applied_generation: int,
        endpoint: str | None,
        pid: int | None,
        s3_status: object = None,
    ) -> dict[str, Any]:
        """Record liveness, the applied generation and the S3 tier's status (``s3_status``: the
        heartbeat's ``s3`` member; absent or null clears what the last heartbeat reported)."""
        stored_s3 = check_s3_status(s3_status)
        if endpoint:
            endpoint = check_endpoint(
                endpoint, loopback_only=self.config.local_agents, node_subnet=self.config.node_subnet
            )
        now = self.clock.now()
        wake = False
        with self.db.write() as session:
            # The node's columns, not its ORM object and the cluster's: every agent calls, and the
            # objects and their flush were half of serve's CPU of an idle 1,024-node cluster.
            if not token:
                raise _missing_token("node token")
            row = self._heartbeat_row(session, cluster_name, token)
            if row is None or row.id != node_id or row.status == NodeStatus.SHUTTING_DOWN:
                raise self._not_own_node(session, cluster_name, node_id, None if row is None else row.id)
            values: dict[str, Any] = {"last_heartbeat": now}
            if row.launch_secret_hash is not None:
                # The agent holds its node token: the launch secret it registered with is spent.
                values["launch_secret_hash"] = None
            if endpoint and endpoint != row.endpoint:
                values["endpoint"] = endpoint
            if pid and pid != row.pid:
                values["pid"] = pid
            if row.s3_status != stored_s3:
                values["s3_status"] = stored_s3
            acked = row.acked_generation
            if acked < applied_generation <= row.generation:
                acked = values["acked_generation"] = applied_generation
                # Unless a push to the node is under way: the pass that claimed it runs again once
                # its pushes are answered. (In a rollout of 1,024 nodes, agents heartbeat after
                # their push and before its answer is recorded: each woke the reconciler for one
                # more pass over every node, which the next UpdateCluster then waited behind.)
                claimed = row.push_claimed_until
                wake = claimed is None or claimed <= now
            elif applied_generation > row.generation and acked != 0:
                # Ahead of every generation this control plane issued: a policy it did not send.
                # Not acknowledged: the reconciler pushes its own generation with a reset and
                # records an event (hyperpod_sim/domain/reconciler.py).
                acked = values["acked_generation"] = 0
                wake = True
            session.execute(update(Node).where(Node.id == row.id).values(**values))
            if row.status == NodeStatus.FAILURE and values.get("endpoint", row.endpoint) is not None:
                node = session.get(Node, row.id)
                assert node is not None  # its row was just written
                node.status_message = None
                events.move(
                    session,
                    node,
                    NodeStatus.PENDING,
                    ids=self.ids,
                    now=now,
                    description="Agent is heartbeating again; the node is recovering.",
                )
                wake = True
            desired = row.generation
            # A push of the generation is on its way (claimed, or due at the reconciler's next
            # pass): the agent waits for it instead of pulling. In a rollout of a large cluster,
            # the agents that heartbeat before their push arrives would otherwise each pull the
            # same policy, and each pull reads the whole ring (docs/nodes.md, "Heartbeats at scale").
            pushing = push_coming(row, row._replace(acked_generation=acked), now)
        if wake:
            self.on_change()
        return {
            "desired_generation": desired,
            "push_pending": pushing and applied_generation < desired,
            "heartbeat_interval_s": self.config.pacing.interval(),
        }

    def record_event(
        self, *, cluster_name: str, node_id: str | None, token: str | None, level: str, message: str
    ) -> dict[str, Any]:
        """An event reported by a node's agent, e.g. the steps it could not persist to S3: about the
        node whose token it presents (``node_id``, when given, must be that node).

        Accepted from a ShuttingDown node of a Deleting cluster too: that is when an agent drains
        its checkpoints to S3 and has the most to report. The node's row stays until its agent has
        exited (hyperpod_sim/domain/reconciler.py), so a draining agent is still known here.
        """
        try:
            event_level = Level(level)
        except ValueError:
            allowed = ", ".join(item.value for item in Level)
            raise AgentProtocolError(
                400, "InvalidEvent", f"level must be one of {allowed}, got {level!r}."
            ) from None
        if not 1 <= len(message) <= MAX_EVENT_MESSAGE:
            raise AgentProtocolError(
                400,
                "InvalidEvent",
                f"message must have 1 to {MAX_EVENT_MESSAGE} characters, got {len(message)}.",
            )
        with self.db.write() as session:
            _cluster, node = self._authenticate(session, cluster_name, token)
            if node_id is not None and node_id != node.id:
                raise AgentProtocolError(
                    403,
                    "WrongNode",
                    f"The token is the node token of node {node.id}; "
                    f"it cannot report events of node {node_id}.",
                )
            event = events.node_event(
                session,
                node,
                message,
                ids=self.ids,
                now=self.clock.now(),
                level=event_level,
            )
            return {"event_id": event.id}

    def policy(self, *, cluster_name: str, node_id: str, token: str | None) -> dict[str, Any]:
        with self.db.read() as session:
            cluster, node = self._own_node(session, cluster_name, node_id, token)
            return self.policy_for(session, cluster, node)

    def _cluster_for(
        self, session: Session, cluster_name: str, token: str | None, *, lock: bool = False
    ) -> Cluster:
        """The cluster of a cluster-wide call (members, namespaces), by any node token of it."""
        self._authenticate(session, cluster_name, token)
        return self._cluster(session, cluster_name, lock=lock)

    def members(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        """The cluster's member list. Built by one thread at a time per cluster: a request that
        comes while a list is being built waits for that list (holding no database connection)
        instead of reading every node's row again. After a rollout every agent asks again: at
        1,024 nodes a save right after one had about twenty threads each reading all the rows,
        the rest waiting for a connection, and agents timed out."""
        with self.db.read() as session:
            cluster_id = self._cluster_for(session, cluster_name, token).id
        with self._members_lock:
            flight = self._members_flights.get(cluster_id)
            leading = flight is None
            if flight is None:
                flight = self._members_flights[cluster_id] = _Flight()
        if not leading:
            flight.done.wait(MEMBERS_WAIT_S)
            if flight.answer is not None:
                return flight.answer
        try:
            with self.db.read() as session:
                cluster = self._cluster(session, cluster_name)
                # Shutting-down nodes too (and nodes moving away, MoveClusterNodes): their agents
                # are draining to S3 and still answer their peers (a persist asks every agent for
                # the ranks it holds) until they exit.
                answer = {
                    "members": [
                        {
                            "node_id": n.id,
                            "instance_group": n.group_name,
                            "status": n.status,
                            "endpoint": n.endpoint,
                        }
                        for n in self._ring_members(session, cluster, leaving=True)
                    ]
                }
            if leading:
                flight.answer = answer
            return answer
        finally:
            if leading:
                with self._members_lock:
                    del self._members_flights[cluster_id]
                flight.done.set()

    # ------------------------------------------------------------------ checkpoint namespaces

    @staticmethod
    def _namespace_doc(namespace: CheckpointNamespace) -> dict[str, Any]:
        return {
            "namespace": namespace.name,
            "num_ranks": namespace.num_ranks,
            "steps_to_retain_per_rank": namespace.steps_retained,
        }

    def _find_namespace(self, session: Session, cluster: Cluster, name: str) -> CheckpointNamespace | None:
        return session.scalars(
            select(CheckpointNamespace).where(
                CheckpointNamespace.cluster_id == cluster.id, CheckpointNamespace.name == name
            )
        ).one_or_none()

    def get_namespace(self, *, cluster_name: str, token: str | None, name: str) -> dict[str, Any]:
        with self.db.read() as session:
            cluster = self._cluster_for(session, cluster_name, token)
            namespace = self._find_namespace(session, cluster, name)
            if namespace is None:
                raise AgentProtocolError(404, "NamespaceNotFound", f"Namespace '{name}' does not exist.")
            return self._namespace_doc(namespace)

    def create_namespace(
        self, *, cluster_name: str, token: str | None, name: str, num_ranks: int, steps_retained: int
    ) -> dict[str, Any]:
        """Create a namespace; its retention is capped at the cluster's in-memory retention. At
        most ``max_namespaces_per_cluster`` per cluster, of at most ``max_namespace_ranks`` ranks,
        with a name S3 keys can carry (no control characters)."""
        problem = namespace_name_problem(name)
        if problem is not None:
            raise AgentProtocolError(400, "InvalidNamespace", f"{problem[0].upper()}{problem[1:]}.")
        problem = num_ranks_problem(num_ranks, most=self.config.max_namespace_ranks)
        if problem is not None:
            raise AgentProtocolError(400, "ValidationException", problem)
        if steps_retained < 1:
            raise AgentProtocolError(
                400, "InvalidNamespace", f"steps_retained must be at least 1, got {steps_retained}."
            )
        with self.db.write() as session:
            cluster = self._cluster_for(session, cluster_name, token, lock=True)
            if self._find_namespace(session, cluster, name) is not None:
                raise AgentProtocolError(409, "NamespaceExists", f"Namespace '{name}' already exists.")
            held = session.scalar(
                select(func.count())
                .select_from(CheckpointNamespace)
                .where(CheckpointNamespace.cluster_id == cluster.id)
            )
            limit = self.config.max_namespaces_per_cluster
            if (held or 0) >= limit:
                raise AgentProtocolError(
                    400,
                    "ResourceLimitExceeded",
                    f"The cluster '{cluster_name}' already has {held} checkpoint namespaces, the limit is "
                    f"{limit}. Delete a namespace it no longer needs.",
                )
            namespace = CheckpointNamespace(
                cluster_id=cluster.id,
                name=name,
                num_ranks=num_ranks,
                # A trainer may keep fewer steps in memory than the cluster's policy, never more.
                steps_retained=min(
                    steps_retained,
                    CheckpointPolicy.from_stored(cluster.checkpoint_policy).in_memory_retention,
                ),
                created_at=self.clock.now(),
            )
            session.add(namespace)
            return self._namespace_doc(namespace)

    def delete_namespace(self, *, cluster_name: str, token: str | None, name: str) -> dict[str, Any]:
        with self.db.write() as session:
            cluster = self._cluster_for(session, cluster_name, token)
            namespace = self._find_namespace(session, cluster, name)
            if namespace is None:
                raise AgentProtocolError(404, "NamespaceNotFound", f"Namespace '{name}' does not exist.")
            session.delete(namespace)
            return {"deleted": name}

    def list_namespaces(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        with self.db.read() as session:
            cluster = self._cluster_for(session, cluster_name, token)
            found = session.scalars(
                select(CheckpointNamespace)
                .where(CheckpointNamespace.cluster_id == cluster.id)
                .order_by(CheckpointNamespace.name)
            )
            return {"namespaces": [self._namespace_doc(n) for n in found]}

    def reset_namespaces(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        with self.db.write() as session:
            cluster = self._cluster_for(session, cluster_name, token)
            result = session.execute(
                delete(CheckpointNamespace).where(CheckpointNamespace.cluster_id == cluster.id)
            )
            return {"deleted": int(getattr(result, "rowcount", 0) or 0)}
