"""What a console shows of the clusters in one answer each (the REST extension ``GET /overview`` and
``GET /clusters/{name}/overview``, hyperpod_sim/api/overview.py).

The clusters' summaries come from the database alone, and so does a cluster's view of its nodes:
their place in the replica ring, their replica peers, their memory budget. What only the agents
know, the bytes each in-memory tier holds, is asked separately (``memory_held``: the agent's
``/metrics``, ``hpsim_tier_bytes_held``), in parallel and with a short timeout, as the checkpoint
listing asks them (domain/checkpoints/listing.py); an agent that does not answer shows no bytes held.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from hyperpod_sim.contracts.agent_api import CONTROL_PLANE_AGENT
from hyperpod_sim.contracts.agent_bodies import S3TierStatus
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy
from hyperpod_sim.domain.checkpoints.listing import NamespaceCheckpoints
from hyperpod_sim.domain.checkpoints.node_policy import memory_budget_bytes, ring
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.lifecycle import NodeStatus
from hyperpod_sim.models import Cluster, Database, Node
from hyperpod_sim.models.groups import TieredStorage

HELD_METRIC = "hpsim_tier_bytes_held"
# Nodes that take part in the replica ring (as the policy builder counts them, domain/nodes/agents.py).
_RING = (NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.FAILURE)


@dataclass(frozen=True)
class OverviewConfig:
    agent_timeout_s: float = 1.0
    workers: int = 16
    memory_scale: float = 1 / 1024


def _orchestrator(cluster: Cluster) -> str | None:
    return next(iter(cluster.orchestrator or {}), None)


def _applied_everywhere(cluster: Cluster) -> int:
    """The newest generation every node not shutting down has applied (0: none, or no node)."""
    nodes = [n for n in cluster.nodes if n.status != NodeStatus.SHUTTING_DOWN]
    return min((n.acked_generation for n in nodes), default=0)


def cluster_summary(cluster: Cluster) -> dict[str, Any]:
    return {
        "ClusterName": cluster.name,
        "ClusterArn": cluster.arn,
        "ClusterStatus": cluster.status,
        "FailureMessage": cluster.failure_message,
        "CreationTime": cluster.creation_time.timestamp(),
        "Orchestrator": _orchestrator(cluster),
        "NodeRecovery": cluster.node_recovery,
        "TieredStorageConfig": (cluster.tiered_storage or TieredStorage(mode="Disable")).wire(),
        "DesiredPolicyGeneration": cluster.generation,
        "AppliedPolicyGeneration": _applied_everywhere(cluster),
        "NodeCounts": dict(sorted(Counter(n.status for n in cluster.nodes).items())),
        "InstanceGroups": [
            {
                "InstanceGroupName": g.name,
                "InstanceType": g.instance_type,
                "TargetCount": g.target_count,
                "CurrentCount": sum(1 for n in cluster.nodes if n.group_name == g.name),
            }
            for g in cluster.instance_groups
        ],
    }


def held_bytes(metrics: str) -> int | None:
    """``hpsim_tier_bytes_held`` from an agent's Prometheus text; None when it is not there."""
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name == HELD_METRIC:
            try:
                return int(float(value))
            except ValueError:
                return None
    return None


class OverviewService:
    """Summaries of every cluster, and one cluster's nodes as a console shows them."""

    def __init__(self, *, db: Database, config: OverviewConfig | None = None) -> None:
        self.db = db
        self.config = config or OverviewConfig()
        self._http = httpx.Client(
            timeout=self.config.agent_timeout_s,
            trust_env=False,
            limits=httpx.Limits(max_connections=self.config.workers),
            headers={"User-Agent": CONTROL_PLANE_AGENT},
        )
        self._pool = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="overview")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def clusters(self) -> list[dict[str, Any]]:
        with self.db.read() as session:
            found = session.scalars(
                select(Cluster)
                .order_by(Cluster.creation_time, Cluster.name)
                .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
            )
            return [cluster_summary(cluster) for cluster in found]

    def cluster(self, *, name: str) -> dict[str, Any]:
        """The cluster's summary, its checkpoint policy and its nodes in ring order."""
        with self.db.read() as session:
            cluster = get_cluster(
                session, name, selectinload(Cluster.instance_groups), selectinload(Cluster.nodes)
            )
            summary = cluster_summary(cluster)
            tiered = cluster.tiered_storage is not None and cluster.tiered_storage.enabled
            policy = CheckpointPolicy.from_stored(cluster.checkpoint_policy)
            factor = policy.replication_factor
            members = ring(cluster, [n for n in cluster.nodes if n.status in _RING])
            others = [n for n in cluster.nodes if n.status not in _RING]
            nodes = []
            for position, node in enumerate([*members, *others]):
                in_ring = position < len(members)
                peers = []
                if in_ring and tiered:
                    count = min(factor, len(members) - 1)
                    peers = [members[(position + k) % len(members)].id for k in range(1, count + 1)]
                s3 = node.s3_status or S3TierStatus()
                nodes.append(
                    {
                        "InstanceId": node.id,
                        "InstanceGroupName": node.group_name,
                        "InstanceType": node.instance_type,
                        "Status": node.status,
                        "StatusMessage": node.status_message,
                        "RingPosition": position if in_ring else None,
                        "ReplicaPeers": peers,
                        "Endpoint": node.endpoint,
                        "AppliedPolicyGeneration": node.acked_generation,
                        "MemoryBudgetBytes": memory_budget_bytes(
                            cluster, node.instance_type, self.config.memory_scale
                        ),
                        "MemoryHeldBytes": None,
                        "S3LagSeconds": s3.lag_seconds,
                        "S3PendingSteps": s3.pending_steps,
                        "LastError": node.last_error or s3.last_error,
                    }
                )
        return {**summary, "CheckpointPolicy": policy.wire(), "Nodes": nodes}

    def memory_held(self, *, name: str) -> dict[str, int | None]:
        """Node id -> the bytes its agent's tier holds, for the cluster's Running nodes with an
        agent (asked in parallel; None for an agent that does not answer)."""
        query = (
            select(Node.id, Node.endpoint)
            .join(Cluster)
            .where(Cluster.name == name, Node.status == NodeStatus.RUNNING, Node.endpoint.is_not(None))
        )
        with self.db.read() as session:
            asked = [(node_id, endpoint) for node_id, endpoint in session.execute(query)]
        found = self._pool.map(self._held, [endpoint for _, endpoint in asked])
        return {node_id: held for (node_id, _), held in zip(asked, found, strict=True)}

    def _held(self, endpoint: str) -> int | None:
        try:
            response = self._http.get(f"{endpoint}/metrics")
        except httpx.HTTPError:
            return None
        return held_bytes(response.text) if response.status_code == 200 else None


def restore_plan(namespace: NamespaceCheckpoints) -> dict[str, Any] | None:
    """What a restore of the namespace would read right now: its newest complete step and, for each
    rank, the tier it comes from (the primary copy in memory, else a replica, else S3) and the
    node; None when no step is complete."""
    step = next((s for s in namespace.steps if s.complete), None)
    if step is None:
        return None
    ranks: dict[str, dict[str, Any]] = {}
    for rank in range(namespace.num_ranks):
        if rank in step.memory:
            ranks[str(rank)] = {"Tier": "Memory", "InstanceId": step.memory[rank]}
        elif step.replica.get(rank):
            ranks[str(rank)] = {"Tier": "Replica", "InstanceId": step.replica[rank][0]}
        else:
            ranks[str(rank)] = {"Tier": "S3", "InstanceId": None}
    return {"Step": step.step, "Ranks": ranks}
