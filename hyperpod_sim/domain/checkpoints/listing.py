"""Where a cluster's checkpoints are: the control plane's view over its agents (the REST extension
``GET /clusters/{name}/checkpoints``).

The control plane knows the namespaces (domain/nodes/agents.py) and every node's agent, but only the
agents know which shards they hold. A listing checks that the agent of every Running node answers
(``GET /health``, in parallel, with a short timeout), then asks a home of each namespace's index
(docs/memory-tier.md, "The namespace index": ``contracts.agent_api.namespace_homes`` over the
members) for every member's index of it (``GET /v1/internal/catalog/{ns}?images=true``: the ranks
each node holds per step, as the primary copy or as a replica of another node's); when neither
home answers, every agent that answered for its own index (``GET /v1/internal/index/{ns}``). Then
one agent for the steps committed on S3 (``GET /v1/internal/s3-steps/{ns}``). An agent that does
not answer is left out and named in ``unreachable``: its shards are missing from the view, though
their replicas on other nodes still show. So a listing costs one request per node and one per
namespace, not one per node and namespace.

"Not on S3" and "S3 unreachable" are told apart: when no agent could list S3 (S3 itself is down,
e.g. the embedded SeaweedFS restarting, or no agent answered), a namespace's steps say ``S3:
null`` (unknown) and the namespace says why in ``S3Error``; ``S3: false`` only ever means that S3
was listed and does not hold the step.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import selectinload

from hyperpod_sim.contracts.agent_api import (
    HEALTH_PATH,
    IMAGES_PARAMETER,
    INTERNAL_CATALOG_ROUTE,
    INTERNAL_INDEX_ROUTE,
    INTERNAL_S3_STEPS_ROUTE,
    agent_path,
    namespace_homes,
)
from hyperpod_sim.contracts.agent_bodies import CatalogImages, S3Steps, ShardIndex
from hyperpod_sim.contracts.s3layout import WRITTEN_BY_AGENTS, WRITTEN_BY_TRAINER
from hyperpod_sim.contracts.shards import step_world_size
from hyperpod_sim.domain.checkpoints.agent_client import AgentConnection, AgentUnreachable
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy
from hyperpod_sim.domain.checkpoints.node_policy import ring
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.lifecycle import LEAVING, LIVE, NodeStatus
from hyperpod_sim.models import CheckpointNamespace, Cluster, Database


@dataclass(frozen=True)
class CheckpointListingConfig:
    # An agent answers its index from memory: one that takes longer is hung or gone.
    agent_timeout_s: float = 2.0
    # The S3 steps are a LIST on S3, through the agent: slower, and only asked of agents that answered.
    s3_timeout_s: float = 10.0
    workers: int = 16


@dataclass(frozen=True)
class StepLocation:
    """One step of a namespace: which node holds each rank's primary copy and its replicas."""

    step: int
    memory: dict[int, str]  # rank -> the node holding its primary copy
    replica: dict[int, list[str]]  # rank -> the nodes holding a replica
    # On S3: committed by the agents (its marker is there) or written whole by the trainer; None
    # when S3 could not be listed (unknown, not "no").
    on_s3: bool | None
    complete: bool  # every rank held in memory somewhere, or on S3
    s3_written_by: str | None = None  # "Agents" or "Trainer" (the library's own S3 writes), when on S3
    # The world size of the job that saved the step (a step saved by fewer ranks than the
    # namespace holds keeps contracts.shards.UNUSED_RANK at the others); None when unknown.
    world_size: int | None = None

    def to_wire(self, own_world_size: int | None = None) -> dict[str, Any]:
        """The step on the wire; ``WorldSize`` only for a step saved at another world size than
        ``own_world_size`` (the namespace's ranks less the metadata rank)."""
        other = self.world_size is not None and self.world_size != own_world_size
        return {
            "Step": self.step,
            **({"WorldSize": self.world_size} if other else {}),
            "Memory": {str(rank): node for rank, node in sorted(self.memory.items())},
            "Replica": {str(rank): nodes for rank, nodes in sorted(self.replica.items())},
            "S3": self.on_s3,
            # Marked only where the trainer wrote it (the library's own S3 writes, no marker).
            **({"S3WrittenBy": self.s3_written_by} if self.s3_written_by == WRITTEN_BY_TRAINER else {}),
            "Complete": self.complete,
        }


@dataclass(frozen=True)
class NamespaceCheckpoints:
    namespace: str
    num_ranks: int
    steps_retained: int
    steps: list[StepLocation]  # newest first
    s3_error: str | None = None  # why S3 could not be listed (then every step's on_s3 is None)

    def to_wire(self) -> dict[str, Any]:
        return {
            "Namespace": self.namespace,
            "NumRanks": self.num_ranks,
            "StepsRetained": self.steps_retained,
            **({"S3Error": self.s3_error} if self.s3_error is not None else {}),
            "Steps": [step.to_wire(max(self.num_ranks - 1, 1)) for step in self.steps],
        }


@dataclass(frozen=True)
class ClusterCheckpoints:
    cluster_name: str
    namespaces: list[NamespaceCheckpoints]
    unreachable: list[str]  # node ids of Running nodes whose agent did not answer

    def to_wire(self) -> dict[str, Any]:
        return {
            "ClusterName": self.cluster_name,
            "Namespaces": [namespace.to_wire() for namespace in self.namespaces],
            "Unreachable": self.unreachable,
        }


@dataclass(frozen=True)
class _Namespace:
    name: str
    num_ranks: int
    steps_retained: int


@dataclass(frozen=True)
class _S3Listing:
    """A namespace's steps on S3 -> who wrote them; or, when S3 could not be listed, why."""

    steps: dict[int, str]
    error: str | None = None
    world_sizes: dict[int, int] = field(default_factory=dict)


def _locate(
    namespace: _Namespace, indexes: list[tuple[str, ShardIndex]], s3: _S3Listing
) -> NamespaceCheckpoints:
    """Merge the agents' indexes (in ring order: the first holder of a primary copy is named)."""
    memory: dict[int, dict[int, str]] = {}
    replica: dict[int, dict[int, list[str]]] = {}
    unused: dict[int, set[int]] = {}
    for node_id, index in indexes:
        for step, ranks in index.unused.items():
            unused.setdefault(step, set()).update(ranks)
        for step, ranks in index.primary.items():
            for rank in ranks:
                memory.setdefault(step, {}).setdefault(rank, node_id)
        for step, ranks in index.replica.items():
            for rank in ranks:
                replica.setdefault(step, {}).setdefault(rank, []).append(node_id)
    everyone = set(range(namespace.num_ranks))
    s3_steps = s3.steps
    steps = []
    for step in sorted(set(memory) | set(replica) | set(s3_steps), reverse=True):
        held = set(memory.get(step, {})) | set(replica.get(step, {}))
        on_s3 = None if s3.error is not None else step in s3_steps
        steps.append(
            StepLocation(
                step=step,
                memory=memory.get(step, {}),
                replica=replica.get(step, {}),
                on_s3=on_s3,
                complete=on_s3 is True or everyone <= held,
                s3_written_by=s3_steps.get(step),
                world_size=(
                    step_world_size(namespace.num_ranks, unused.get(step, ()))
                    if held
                    else s3.world_sizes.get(step)
                ),
            )
        )
    return NamespaceCheckpoints(
        namespace.name, namespace.num_ranks, namespace.steps_retained, steps, s3_error=s3.error
    )


class CheckpointCatalog:
    """Lists a cluster's checkpoints by asking its agents (see the module docstring)."""

    def __init__(self, *, db: Database, config: CheckpointListingConfig | None = None) -> None:
        self.db = db
        self.config = config or CheckpointListingConfig()
        self._pool = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="checkpoints")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def list_checkpoints(self, *, name: str) -> ClusterCheckpoints:
        """Every namespace of the cluster (by name or ARN) with its steps, newest first."""
        with self.db.read() as session:
            cluster = get_cluster(
                session, name, selectinload(Cluster.instance_groups), selectinload(Cluster.nodes)
            )
            cluster_name, token = cluster.name, cluster.token
            running = [n for n in cluster.nodes if n.status == NodeStatus.RUNNING and n.endpoint]
            agents = [(n.id, str(n.endpoint)) for n in ring(cluster, running)]
            # The member list the agents compute a namespace's homes from (``/members``).
            members = [
                n.id for n in cluster.nodes if n.endpoint and (n.status in LIVE or n.status in LEAVING)
            ]
            has_s3 = CheckpointPolicy.from_stored(cluster.checkpoint_policy).s3_base_uri is not None
            namespaces = [
                _Namespace(n.name, n.num_ranks, n.steps_retained)
                for n in session.scalars(
                    select(CheckpointNamespace)
                    .where(CheckpointNamespace.cluster_id == cluster.id)
                    .order_by(CheckpointNamespace.name)
                )
            ]
        if not namespaces:
            return ClusterCheckpoints(cluster_name, [], [])
        alive = list(self._pool.map(lambda agent: self._answers(agent[1], token), agents))
        live = [agent for agent, ok in zip(agents, alive, strict=True) if ok]
        unreachable = [node_id for (node_id, _), ok in zip(agents, alive, strict=True) if not ok]
        from_homes = list(self._pool.map(lambda ns: self._from_homes(ns, members, live, token), namespaces))
        missing = [ns for ns, found in zip(namespaces, from_homes, strict=True) if found is None]
        # Namespaces no home answered for: every live agent's own index, as before the index.
        asking = live if missing else []
        asked = list(self._pool.map(lambda agent: self._indexes(agent[1], missing, token), asking))
        reachable = [(agent, found) for agent, found in zip(asking, asked, strict=True) if found is not None]
        unreachable += [node_id for (node_id, _), found in zip(asking, asked, strict=True) if found is None]
        endpoints = [endpoint for _, endpoint in live]
        s3_steps: list[_S3Listing] = [_S3Listing({}) for _ in namespaces]
        if has_s3 and endpoints:
            s3_steps = list(self._pool.map(lambda ns: self._s3_steps(endpoints, ns.name, token), namespaces))
        elif has_s3:
            nobody = _S3Listing({}, "S3 was not listed: no agent of the cluster answered")
            s3_steps = [nobody for _ in namespaces]
        listed = [
            _locate(
                ns,
                homed
                if homed is not None
                else [(node_id, found[ns.name]) for (node_id, _), found in reachable],
                on_s3,
            )
            for ns, homed, on_s3 in zip(namespaces, from_homes, s3_steps, strict=True)
        ]
        return ClusterCheckpoints(cluster_name, listed, list(dict.fromkeys(unreachable)))

    def _answers(self, endpoint: str, token: str) -> bool:
        try:
            with AgentConnection(endpoint, token=token, timeout=self.config.agent_timeout_s) as agent:
                return agent.call("GET", HEALTH_PATH).status == 200
        except AgentUnreachable:
            return False

    def _from_homes(
        self, namespace: _Namespace, members: list[str], live: list[tuple[str, str]], token: str
    ) -> list[tuple[str, ShardIndex]] | None:
        """Every live agent's index of ``namespace`` (in ring order) as a home of it keeps them;
        None when no home answers (down, or not a home by its own member list)."""
        endpoints = dict(live)
        for home in namespace_homes(namespace.name, members):
            if home not in endpoints:
                continue
            path = agent_path(INTERNAL_CATALOG_ROUTE, namespace=namespace.name)
            try:
                with AgentConnection(
                    endpoints[home], token=token, timeout=self.config.agent_timeout_s
                ) as agent:
                    answer = agent.call("GET", f"{path}?{IMAGES_PARAMETER}=true")
                if answer.status != 200:
                    continue
                images = {image.node_id: image for image in CatalogImages.parse(answer.text).images}
            except (AgentUnreachable, ValueError):  # a ValidationError (off the contract) is a ValueError
                continue
            return [(node_id, images[node_id]) for node_id, _ in live if node_id in images]
        return None

    def _indexes(
        self, endpoint: str, namespaces: list[_Namespace], token: str
    ) -> dict[str, ShardIndex] | None:
        """One agent's index of every namespace, over one connection; None as soon as one call
        fails (the agent is left out: a hung one must not cost a timeout per namespace)."""
        found: dict[str, ShardIndex] = {}
        try:
            with AgentConnection(endpoint, token=token, timeout=self.config.agent_timeout_s) as agent:
                for namespace in namespaces:
                    answer = agent.call("GET", agent_path(INTERNAL_INDEX_ROUTE, namespace=namespace.name))
                    if answer.status != 200:
                        return None
                    found[namespace.name] = ShardIndex.parse(answer.text)
        except (AgentUnreachable, ValueError):  # a ValidationError (off the contract) is a ValueError
            return None
        return found

    def _s3_steps(self, endpoints: list[str], name: str, token: str) -> _S3Listing:
        """The namespace's steps on S3 -> who wrote them (``Agents``: committed with a marker,
        ``Trainer``: the library wrote them whole), from the first agent that answers (every agent
        of the cluster persists to the same place); if none can (S3 is down: 503 S3Unavailable),
        why."""
        problems: list[str] = []
        for endpoint in endpoints:
            try:
                with AgentConnection(
                    endpoint,
                    token=token,
                    timeout=self.config.s3_timeout_s,
                    connect_timeout=self.config.agent_timeout_s,
                ) as agent:
                    answer = agent.call("GET", agent_path(INTERNAL_S3_STEPS_ROUTE, namespace=name))
                if answer.status == 200:
                    listed = S3Steps.parse(answer.text)
                    trainer = set(listed.trainer)
                    return _S3Listing(
                        {
                            step: WRITTEN_BY_TRAINER if step in trainer else WRITTEN_BY_AGENTS
                            for step in listed.steps
                        },
                        world_sizes=dict(listed.world_sizes),
                    )
                problems.append(f"{answer.status} {_message(answer.json())}")
            except AgentUnreachable as exc:
                problems.append(f"the agent at {endpoint} did not answer ({exc})")
            except (ValueError, KeyError, TypeError, AttributeError):
                problems.append(f"the agent at {endpoint} answered off the contract")
        return _S3Listing({}, "S3 could not be listed: " + "; ".join(dict.fromkeys(problems)))


def _message(doc: object) -> str:
    """An agent's error answer, in a few words."""
    if isinstance(doc, dict):
        return " ".join(str(doc[key]) for key in ("error", "message") if key in doc)[:500]
    return str(doc)[:200]
