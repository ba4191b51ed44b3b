"""The control plane's side of the agent protocol: registration, heartbeats, policy pulls.

See docs/agent-protocol.md. Tokens are compared in constant time; a missing token is 401, a wrong
one 403.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, selectinload

from domain import events
from domain.checkpoint_policy import CheckpointPolicy
from domain.clock import Clock, Ids
from domain.errors import AgentProtocolError
from domain.lifecycle import NodeStatus
from domain.policy import build_policy, ring
from models import CheckpointNamespace, Cluster, Database, Node

LIVE = (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.FAILURE)
MAX_RANKS = 1_000_000


@dataclass(frozen=True)
class AgentConfig:
    heartbeat_interval_s: float
    memory_scale: float


def check_token(presented: str | None, expected: str) -> None:
    if not presented:
        raise AgentProtocolError(401, "MissingToken", "Authorization: Bearer <cluster token> is required.")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise AgentProtocolError(403, "InvalidToken", "The token is not valid for this cluster.")


class AgentService:
    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        ids: Ids,
        config: AgentConfig,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.config = config
        self.on_change = on_change

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _cluster(session: Session, name: str, *, lock: bool = False) -> Cluster:
        query = (
            select(Cluster)
            .where(Cluster.name == name)
            .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
        )
        if lock:
            query = query.with_for_update()
        cluster = session.scalars(query).one_or_none()
        if cluster is None:
            raise AgentProtocolError(404, "ClusterNotFound", f"Cluster '{name}' does not exist.")
        return cluster

    @staticmethod
    def _node(cluster: Cluster, node_id: str) -> Node:
        for node in cluster.nodes:
            if node.id == node_id and node.status != NodeStatus.SHUTTING_DOWN:
                return node
        raise AgentProtocolError(
            404, "NodeNotFound", f"Node {node_id} is not a node of cluster '{cluster.name}'."
        )

    def policy_for(self, cluster: Cluster, node: Node) -> dict[str, Any]:
        members = [n for n in cluster.nodes if n.status in LIVE]
        return build_policy(cluster, node, members, memory_scale=self.config.memory_scale)

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
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_name, lock=True)
            if node_id is not None:
                check_token(token, cluster.token)
                node = self._node(cluster, node_id)
            else:
                check_token(token, cluster.bootstrap_token)
                slots = sorted(
                    (n for n in cluster.nodes if n.status == NodeStatus.PENDING and n.endpoint is None),
                    key=lambda n: (n.launch_time, n.id),
                )
                if not slots:
                    raise AgentProtocolError(
                        409, "NoPendingSlot", f"Cluster '{cluster.name}' has no node waiting for an agent."
                    )
                node = slots[0]
            rebinding = node.endpoint is not None and node.endpoint != endpoint
            node.endpoint = endpoint
            node.pid = pid
            node.registered_at = now
            node.last_heartbeat = now
            node.push_attempts = 0
            node.next_push_at = None
            node.last_error = None
            if node.status == NodeStatus.FAILURE:
                node.status = NodeStatus.PENDING
                node.status_message = None
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                node=node,
                description=f"Agent {'re-registered' if rebinding else 'registered'} at {endpoint}.",
            )
            answer = {
                "node_id": node.id,
                "cluster_token": cluster.token,
                "heartbeat_interval_s": self.config.heartbeat_interval_s,
                "policy": self.policy_for(cluster, node),
            }
        self.on_change()
        return answer

    def heartbeat(
        self,
        *,
        cluster_name: str,
        node_id: str,
        token: str | None,
        applied_generation: int,
        endpoint: str | None,
        pid: int | None,
    ) -> dict[str, Any]:
        now = self.clock.now()
        wake = False
        with self.db.write() as session:
            # One node's row and its cluster's, not the cluster's whole node set: every node
            # heartbeats every second, so this must not grow with the cluster.
            row = session.execute(
                select(Cluster, Node)
                .join(Node, Node.cluster_id == Cluster.id)
                .where(Cluster.name == cluster_name, Node.id == node_id)
            ).one_or_none()
            if row is None:
                cluster = self._cluster(session, cluster_name)  # 404 for the cluster, if that is it
                check_token(token, cluster.token)
                raise AgentProtocolError(
                    404, "NodeNotFound", f"Node {node_id} is not a node of cluster '{cluster_name}'."
                )
            cluster, node = row
            check_token(token, cluster.token)
            if node.status == NodeStatus.SHUTTING_DOWN:
                raise AgentProtocolError(
                    404, "NodeNotFound", f"Node {node_id} is not a node of cluster '{cluster_name}'."
                )
            node.last_heartbeat = now
            if endpoint and endpoint != node.endpoint:
                node.endpoint = endpoint
            if pid:
                node.pid = pid
            if node.acked_generation < applied_generation <= cluster.generation:
                node.acked_generation = applied_generation
                wake = True
            if node.status == NodeStatus.FAILURE and node.endpoint is not None:
                node.status = NodeStatus.PENDING
                node.status_message = None
                events.record(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    node=node,
                    description="Agent is heartbeating again; the node is recovering.",
                )
                wake = True
            desired = cluster.generation
        if wake:
            self.on_change()
        return {"desired_generation": desired}

    def policy(self, *, cluster_name: str, node_id: str, token: str | None) -> dict[str, Any]:
        with self.db.read() as session:
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            return self.policy_for(cluster, self._node(cluster, node_id))

    def members(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        with self.db.read() as session:
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            live = [n for n in cluster.nodes if n.status in LIVE]
            return {
                "members": [
                    {
                        "node_id": n.id,
                        "instance_group": n.group_name,
                        "status": n.status,
                        "endpoint": n.endpoint,
                    }
                    for n in ring(cluster, live)
                ]
            }

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
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            namespace = self._find_namespace(session, cluster, name)
            if namespace is None:
                raise AgentProtocolError(404, "NamespaceNotFound", f"Namespace '{name}' does not exist.")
            return self._namespace_doc(namespace)

    def create_namespace(
        self, *, cluster_name: str, token: str | None, name: str, num_ranks: int, steps_retained: int
    ) -> dict[str, Any]:
        """Create a namespace; its retention is capped at the cluster's in-memory retention."""
        if not 1 <= num_ranks <= MAX_RANKS:
            raise AgentProtocolError(
                400, "InvalidNamespace", f"num_ranks must be between 1 and {MAX_RANKS}, got {num_ranks}."
            )
        if steps_retained < 1:
            raise AgentProtocolError(
                400, "InvalidNamespace", f"steps_retained must be at least 1, got {steps_retained}."
            )
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_name, lock=True)
            check_token(token, cluster.token)
            if self._find_namespace(session, cluster, name) is not None:
                raise AgentProtocolError(409, "NamespaceExists", f"Namespace '{name}' already exists.")
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
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            namespace = self._find_namespace(session, cluster, name)
            if namespace is None:
                raise AgentProtocolError(404, "NamespaceNotFound", f"Namespace '{name}' does not exist.")
            session.delete(namespace)
            return {"deleted": name}

    def list_namespaces(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        with self.db.read() as session:
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            found = session.scalars(
                select(CheckpointNamespace)
                .where(CheckpointNamespace.cluster_id == cluster.id)
                .order_by(CheckpointNamespace.name)
            )
            return {"namespaces": [self._namespace_doc(n) for n in found]}

    def reset_namespaces(self, *, cluster_name: str, token: str | None) -> dict[str, Any]:
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_name)
            check_token(token, cluster.token)
            result = session.execute(
                delete(CheckpointNamespace).where(CheckpointNamespace.cluster_id == cluster.id)
            )
            return {"deleted": int(getattr(result, "rowcount", 0) or 0)}
