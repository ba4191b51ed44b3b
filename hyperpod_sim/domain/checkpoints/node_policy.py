"""The policy document the control plane pushes to each node's agent (docs/agent-protocol.md)."""

from __future__ import annotations

from collections.abc import Sequence

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


def ring(cluster: Cluster, nodes: Sequence[Node]) -> list[Node]:
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
    cluster: Cluster, node: Node, members: Sequence[Node], *, memory_scale: float, s3_endpoint: S3Endpoint
) -> NodePolicy:
    """The policy of ``node``, given the cluster's live members (the replica ring). Its
    ``document()`` is what the node's agent gets."""
    tiered = cluster.tiered_storage
    enabled = tiered is not None and tiered.enabled
    # Peers are named by node id: their endpoints come and go with agent restarts without
    # changing the policy; agents look them up with the members call of the agent API.
    checkpoint = CheckpointPolicy.from_stored(cluster.checkpoint_policy)
    ordered = ring(cluster, members)
    peers: list[Peer] = []
    if enabled and node in ordered and len(ordered) > 1:
        index = ordered.index(node)
        factor = min(checkpoint.replication_factor, len(ordered) - 1)
        for step in range(1, factor + 1):
            peers.append(Peer(node_id=ordered[(index + step) % len(ordered)].id))
    s3 = s3_document(checkpoint, s3_endpoint) if enabled else None
    return NodePolicy(
        generation=cluster.generation,
        cluster_name=cluster.name,
        cluster_id=cluster.id,
        node_id=node.id,
        instance_group=node.group_name,
        instance_type=node.instance_type,
        tiered_storage=TieredStorage(
            enabled=enabled,
            memory_percentage=tiered.instance_memory_allocation_percentage if tiered and enabled else None,
        ),
        memory_budget_bytes=memory_budget_bytes(cluster, node.instance_type, memory_scale),
        in_memory_retention=checkpoint.in_memory_retention,
        replication=Replication(factor=checkpoint.replication_factor if enabled else 0, peers=tuple(peers)),
        s3=S3Policy.model_validate(s3) if s3 is not None else None,
        # Injected faults the agent applies itself (domain/faults.py): S3 faults, in its S3 client.
        faults=Faults(s3=s3_fault_policy(cluster)),
        # Who may write to the agent's checkpoint routes (AgentAccess), with the token's hash.
        checkpoint_access=CheckpointAccess.model_validate(
            access_document(checkpoint, cluster.checkpoint_token)
        ),
    )
