"""Which steps of a namespace are complete, as pure functions of the indexes the agents hold, and
the one place that gathers those indexes (this node's store and every other agent's).

A step is complete when every rank of the namespace (the metadata rank included) is held somewhere
in the cluster: a step that a crash left half-written is never listed (docs/memory-tier.md). A step
saved by a job of fewer ranks holds ``shards.UNUSED_RANK`` at the ranks it did not have; its world
size is the lowest of them (``contracts.shards.step_world_size``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Set

from hyperpod_sim.agents.cluster import ClusterView
from hyperpod_sim.agents.http.client import Answer
from hyperpod_sim.agents.store import ShardInfo, ShardStore
from hyperpod_sim.contracts.agent_api import INTERNAL_INDEX_ROUTE, agent_path, namespace_homes
from hyperpod_sim.contracts.agent_bodies import ShardIndex, problem_of
from hyperpod_sim.contracts.shards import UNUSED_RANK_CHECKSUM, step_world_size

log = logging.getLogger("hyperpod_sim.agents.tier")

Held = Mapping[int, Iterable[int]]  # step -> ranks


def merge(indexes: Iterable[Held]) -> dict[int, set[int]]:
    """The union of several ``step -> ranks`` indexes."""
    held: dict[int, set[int]] = {}
    for index in indexes:
        for step, ranks in index.items():
            held.setdefault(step, set()).update(ranks)
    return held


def complete_steps(num_ranks: int, indexes: Iterable[Held]) -> list[int]:
    """The steps whose every rank ``0..num_ranks-1`` one of ``indexes`` holds, newest first."""
    everyone = set(range(num_ranks))
    return sorted((step for step, ranks in merge(indexes).items() if everyone <= ranks), reverse=True)


def world_sizes(num_ranks: int, steps: Iterable[int], unused: Iterable[Held]) -> dict[int, int]:
    """The world size of the job that saved each of ``steps``, from the ranks the indexes hold
    ``UNUSED_RANK`` at (``unused``)."""
    merged = merge(unused)
    return {step: step_world_size(num_ranks, merged.get(step, ())) for step in steps}


def local_index(shards: Iterable[ShardInfo], node_id: str | None) -> ShardIndex:
    """This node's index of a namespace, as ``/v1/internal/index`` answers it: ``steps`` every
    copy, ``primary`` this node's own shards, ``replica`` the copies it holds of other nodes'
    shards (``steps`` is their union); steps and ranks in order."""
    held: dict[str, dict[int, set[int]]] = {"steps": {}, "primary": {}, "replica": {}, "unused": {}}
    for info in shards:
        kind = "primary" if info.replica_of is None else "replica"
        members = ("steps", kind, "unused") if info.checksum == UNUSED_RANK_CHECKSUM else ("steps", kind)
        for member in members:
            held[member].setdefault(info.key.step, set()).add(info.key.rank)
    ordered = {
        member: {step: tuple(sorted(ranks)) for step, ranks in sorted(steps.items())}
        for member, steps in held.items()
    }
    return ShardIndex(
        node_id=node_id,
        steps=ordered["steps"],
        primary=ordered["primary"],
        replica=ordered["replica"],
        unused=ordered["unused"],
    )


def peer_index(response: Answer) -> ShardIndex | None:
    """A peer's answer to ``GET /v1/internal/index``, or None when it is not one (refused, off
    the contract)."""
    if response.status_code != 200:
        return None
    try:
        return ShardIndex.parse(response.content)
    except ValueError as exc:
        log.warning("an agent's index is off the contract: %s", problem_of(exc))
        return None


def retention_plan(
    steps_with_marker: Iterable[int], steps_with_objects: Iterable[int], retention: int | None
) -> tuple[set[int], set[int]]:
    """What S3 retention deletes: (committed steps beyond the newest ``retention`` (0 or None: all kept),
    steps below the newest committed one that have objects but never got a marker)."""
    committed = sorted(set(steps_with_marker), reverse=True)
    if not committed:
        return set(), set()
    doomed = set(committed[retention:]) if retention else set()
    abandoned = {s for s in steps_with_objects if s < committed[0] and s not in committed}
    return doomed, abandoned


async def cluster_complete_steps(cluster: ClusterView, store: ShardStore, name: str) -> list[int]:
    """The complete steps of ``name`` across the cluster, newest first: this node's store and the
    index of every agent that answers."""
    return list(await cluster_steps(cluster, store, name))


async def cluster_steps(cluster: ClusterView, store: ShardStore, name: str) -> dict[int, int]:
    """The complete steps of ``name`` across the cluster, newest first, each with the world size
    of the job that saved it: this node's store and the index of every agent that answers."""
    namespace = await cluster.namespace(name)
    own = local_index(store.shards(name), None)
    indexes: list[Held] = [own.steps]
    unused: list[Held] = [own.unused]
    for _, response in await cluster.fan_out("GET", agent_path(INTERNAL_INDEX_ROUTE, namespace=name)):
        index = peer_index(response)
        if index is not None:
            indexes.append(index.steps)
            unused.append(index.unused)
    steps = complete_steps(namespace.num_ranks, indexes)
    return world_sizes(namespace.num_ranks, steps, unused)


# ------------------------------------------------------------------ the namespace index's homes


def homes(namespace: str, node_ids: Iterable[str]) -> list[str]:
    """The two agents that keep ``namespace``'s index, best first (``contracts.agent_api``:
    the control plane computes them alike)."""
    return namespace_homes(namespace, node_ids)


class HomeView:
    """What a home keeps of one namespace: each member's latest image of what it holds (its
    ``ShardIndex``) with the member set it arrived under, and the member set the view was last
    made whole for (``warm_for``; None: never, so the view may lack a node that has not reported
    to it)."""

    def __init__(self) -> None:
        self.images: dict[str, ShardIndex] = {}
        # Node id -> the member set (``ClusterView.member_ids``, compared by identity) this home
        # knew when the node's image arrived: an image that came under another set may have
        # missed the reports sent to other homes meanwhile.
        self.arrived_under: dict[str, frozenset[str]] = {}
        self.warm_for: frozenset[str] | None = None
        # The complete steps, computed once per change of the images (num_ranks -> steps): a
        # restart's `latest`s, one per rank, cost one merge, not one each.
        self._steps: dict[int, dict[int, int]] = {}

    def offer(self, image: ShardIndex, under: frozenset[str]) -> bool:
        """Keep ``image``, which arrived while this home knew the member set ``under``, unless a
        newer one of its node (a higher ``seq``) is kept already: an image that arrives late (a
        retried report, an index fetched while a report landed) never replaces a newer one.
        Whether it was kept."""
        if image.node_id is None:
            return False
        held = self.images.get(image.node_id)
        if held is not None and held.seq >= image.seq:
            return False
        self.images[image.node_id] = image
        self.arrived_under[image.node_id] = under
        self._steps.clear()
        return True

    def unknown(self, everyone: frozenset[str]) -> list[str]:
        """The members of ``everyone`` whose image this view lacks, or holds from under another
        member set: what a home asks for before it answers for ``everyone``."""
        return [n for n in everyone if self.arrived_under.get(n) is not everyone]

    def retain(self, members: Set[str]) -> None:
        """Forget the images of nodes that are no longer members."""
        for node_id in [n for n in self.images if n not in members]:
            del self.images[node_id]
            del self.arrived_under[node_id]
            self._steps.clear()

    def steps(self, num_ranks: int) -> dict[int, int]:
        """The complete steps, newest first, each with the world size that saved it."""
        if num_ranks not in self._steps:
            images = list(self.images.values())
            steps = complete_steps(num_ranks, (image.steps for image in images))
            self._steps[num_ranks] = world_sizes(num_ranks, steps, (image.unused for image in images))
        return dict(self._steps[num_ranks])

    def holders(self, step: int, rank: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The nodes holding the step's ``rank`` (None: any rank of it): (own shards, replicas)."""

        def holds(held: Mapping[int, tuple[int, ...]]) -> bool:
            ranks = held.get(step, ())
            return bool(ranks) if rank is None else rank in ranks

        primary = tuple(sorted(n for n, image in self.images.items() if holds(image.primary)))
        replica = tuple(sorted(n for n, image in self.images.items() if holds(image.replica)))
        return primary, replica
