"""The policy document the control plane pushes to each node's agent (docs/agent-protocol.md)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple, Protocol, TypeVar

from hyperpod_sim.contracts.policy import (
    CheckpointAccess,
    Faults,
    NodePolicy,
    Peer,
    Replication,
    S3Policy,
    TieredStorage,
)
from hyperpod_sim.domain.checkpoints.cluster_policy import (
    CheckpointPolicy,
    S3Endpoint,
    access_document,
    s3_document,
)
from hyperpod_sim.domain.faults import s3_fault_policy
from hyperpod_sim.domain.instance_types import instance_memory_bytes
from hyperpod_sim.models import Cluster, Node


class RingMember(Protocol):
    """What the ring orders a node by: a ``Node``, or a ``RingRow`` read without the rest."""

    @property
    def id(self) -> str: ...
    @property
    def group_name(self) -> str: ...
    @property
    def slot(self) -> int: ...
    @property
    def launch_time(self) -> datetime: ...


class RingRow(NamedTuple):
    """A node's columns that the ring and the agents' members call need, read as one row."""

    id: str
    group_name: str
    slot: int
    launch_time: datetime
    status: str
    endpoint: str | None


M = TypeVar("M", bound=RingMember)


def ring(cluster: Cluster, nodes: Sequence[M]) -> list[M]:
    """The cluster's nodes in a stable ring order: group position, then slot in the group (a
    replacement takes the slot, so the ring position, of the node it replaces)."""
    position = {group.name: group.position for group in cluster.instance_groups}
    return sorted(nodes, key=lambda n: (position.get(n.group_name, 1 << 30), n.slot, n.launch_time, n.id))


def memory_budget_bytes(cluster: Cluster, instance_type: str, memory_scale: float) -> int:
    tiered = cluster.tiered_storage
    if tiered is None or not tiered.enabled or tiered.instance_memory_allocation_percentage is None:
        return 0
    percentage = tiered.instance_memory_allocation_percentage
    return int(instance_memory_bytes(instance_type) * percentage / 100 * memory_scale)


def build_policy(
    cluster: Cluster,
    node: Node,
    members: Sequence[RingMember],
    *,
    memory_scale: float,
    s3_endpoint: S3Endpoint,
) -> NodePolicy:
    """The policy of ``node``, given the cluster's live members (the replica ring). Its
    ``document()`` is what the node's agent gets."""
    return PolicyBuilder(cluster, members, memory_scale=memory_scale, s3_endpoint=s3_endpoint).policy(node)


class PolicyBuilder:
    """The policies of a cluster's nodes: what they share (the ring, the checkpoint policy, S3,
    faults, access) worked out once, so that a rollout to n nodes costs O(n), not O(n²)."""

    def __init__(
        self, cluster: Cluster, members: Sequence[RingMember], *, memory_scale: float, s3_endpoint: S3Endpoint
    ) -> None:
        self.cluster = cluster
        self.memory_scale = memory_scale
        tiered = cluster.tiered_storage
        self.enabled = tiered is not None and tiered.enabled
        self.tiered = TieredStorage(
            enabled=self.enabled,
            memory_percentage=tiered.instance_memory_allocation_percentage
            if tiered and self.enabled
            else None,
        )
        self.checkpoint = CheckpointPolicy.from_stored(cluster.checkpoint_policy)
        # Peers are named by node id: their endpoints come and go with agent restarts without
        # changing the policy; agents look them up with the members call of the agent API.
        self.ring = ring(cluster, members)
        self.place = {n.id: i for i, n in enumerate(self.ring)}
        s3 = s3_document(self.checkpoint, s3_endpoint) if self.enabled else None
        self.s3 = S3Policy.model_validate(s3) if s3 is not None else None
        # Injected faults the agent applies itself (domain/faults.py): S3 faults, in its S3 client.
        self.faults = Faults(s3=s3_fault_policy(cluster))
        # Who may write to the agent's checkpoint routes (AgentAccess), with the token's hash.
        self.access = CheckpointAccess.model_validate(
            access_document(self.checkpoint, cluster.checkpoint_token)
        )
        self._budgets: dict[str, int] = {}

    def peers(self, node: Node) -> tuple[Peer, ...]:
        index = self.place.get(node.id)
        if not self.enabled or index is None or len(self.ring) < 2:
            return ()
        factor = min(self.checkpoint.replication_factor, len(self.ring) - 1)
        return tuple(
            Peer(node_id=self.ring[(index + step) % len(self.ring)].id) for step in range(1, factor + 1)
        )

    def policy(self, node: Node) -> NodePolicy:
        budget = self._budgets.get(node.instance_type)
        if budget is None:
            budget = self._budgets[node.instance_type] = memory_budget_bytes(
                self.cluster, node.instance_type, self.memory_scale
            )
        return NodePolicy(
            generation=self.cluster.generation,
            cluster_name=self.cluster.name,
            cluster_id=self.cluster.id,
            node_id=node.id,
            instance_group=node.group_name,
            instance_type=node.instance_type,
            tiered_storage=self.tiered,
            memory_budget_bytes=budget,
            in_memory_retention=self.checkpoint.in_memory_retention,
            replication=Replication(
                factor=self.checkpoint.replication_factor if self.enabled else 0, peers=self.peers(node)
            ),
            s3=self.s3,
            faults=self.faults,
            checkpoint_access=self.access,
        )
