"""What the memory tier's parts share: a namespace, the tier's error, its counters, a copy of a shard
to send, and the checks of what a request carries (a namespace, a shard key, ``Shard-Meta``, whose
format is :mod:`contracts.shards`').

Nothing here builds an HTTP response: :mod:`agents.tierroutes` turns a :class:`TierError` and the
tier's results into responses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hyperpod_sim.agents.numbers import canonical_int
from hyperpod_sim.agents.store import ShardInfo, ShardKey, check_namespace
from hyperpod_sim.contracts.agent_bodies import NamespaceAnswer
from hyperpod_sim.contracts.limits import namespace_name_problem
from hyperpod_sim.contracts.shards import ShardMetaError, checked_save, parse_save
from hyperpod_sim.contracts.shards import parse_shard_meta as parse_checksum_header

MAX_NODE_ID_CHARS = 128  # a replica's ``owner`` (a node id; stored in the shard's sidecar)


@dataclass(frozen=True)
class Namespace:
    name: str
    num_ranks: int
    steps_retained: int

    def answer(self) -> NamespaceAnswer:
        return NamespaceAnswer(
            namespace=self.name, num_ranks=self.num_ranks, steps_to_retain_per_rank=self.steps_retained
        )

    @classmethod
    def from_doc(cls, name: str, doc: dict[str, Any]) -> Namespace:
        """From the control plane's answer about a namespace."""
        return cls(name, int(doc["num_ranks"]), int(doc["steps_to_retain_per_rank"]))


class TierError(Exception):
    """A refusal of the tier: its HTTP status, error code, message and extra members of the body."""

    def __init__(self, status: int, error: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.extra = extra


@dataclass
class TierCounters:
    replications_total: int = 0
    replication_failures_total: int = 0
    remote_reads_total: int = 0
    # Shards stored but not yet on every replica peer, and when the oldest of them was stored.
    replication_pending: dict[ShardKey, float] = field(default_factory=dict)

    def replication_lag_s(self, now: float) -> float:
        return max((now - since for since in self.replication_pending.values()), default=0.0)


@dataclass(frozen=True, kw_only=True)
class ShardCopy:
    """A good copy of a shard, to send: its bytes, checksum, the tier it came from (``memory``,
    ``replica``, ``peer``, ``s3``) and what to call once the bytes are sent (a mapped view's
    release)."""

    body: bytes | memoryview
    checksum: str
    tier: str
    on_sent: Callable[[], None] | None = None
    save: str | None = None  # the save of its step it belongs to, when its sender named one


def tier_of(info: ShardInfo) -> str:
    """The ``X-Hpsim-Tier`` of a copy held here: this node's own shard, or a replica of another's."""
    return "memory" if info.replica_of is None else "replica"


def parse_shard_meta(header: str | None) -> str:
    """The base64 xxh3_128 checksum of a ``Shard-Meta`` header; a TierError 400 if it is not usable."""
    try:
        return parse_checksum_header(header)
    except ShardMetaError as exc:
        raise TierError(400, exc.error, str(exc)) from exc


def parse_shard_save(header: str | None) -> str | None:
    """The save id of a ``Shard-Meta`` header (None: it names none); a TierError 400 if it is not one."""
    try:
        return parse_save(header)
    except ShardMetaError as exc:
        raise TierError(400, exc.error, str(exc)) from exc


def parse_save_id(value: str, *, what: str) -> str:
    """A save id given in a query; a TierError 400 (InvalidParameter) if it is not one."""
    try:
        return checked_save(value, what=what)
    except ShardMetaError as exc:
        raise TierError(400, "InvalidParameter", str(exc)) from exc


def parse_key(name: str, rank: str, step: str) -> ShardKey:
    """The shard a path names: a namespace that fits in a directory name, and a rank and step in
    their one canonical spelling (hyperpod_sim/agents/numbers.py). A TierError 400 otherwise."""
    checked_namespace(name)
    try:
        return ShardKey(name, canonical_int(rank, what="rank"), canonical_int(step, what="step"))
    except ValueError as exc:
        raise TierError(400, "InvalidShard", str(exc)) from exc


def checked_namespace(name: str) -> str:
    """``name`` if a namespace of that name can be stored (on disk: one directory name); a
    TierError 400 otherwise."""
    try:
        check_namespace(name)
    except ValueError as exc:
        raise TierError(400, "InvalidNamespace", str(exc)) from exc
    return name


def checked_new_namespace(name: str) -> str:
    """``name`` if a namespace may be created with it: it can be stored (``checked_namespace``)
    and persisted to S3 (no control characters: ``contracts.limits.namespace_name_problem``); a
    TierError 400 otherwise. Only creation checks the second: a namespace made before the rule
    can still be read and deleted."""
    checked_namespace(name)
    problem = namespace_name_problem(name)
    if problem is not None:
        raise TierError(400, "InvalidNamespace", problem)
    return name


class Upload(Protocol):
    """A shard's bytes on their way in (an HTTP body), with what the sender says about them; each
    read of a part raises TierError when that part is not usable."""

    def checksum(self) -> str:
        """The checksum the sender gives (base64 xxh3_128)."""
        ...

    def save(self) -> str | None:
        """The save of its step the shard belongs to, if the sender names one."""
        ...

    def size(self) -> int:
        """How many bytes come."""
        ...

    async def fill(self, view: memoryview) -> None:
        """Receive exactly ``len(view)`` bytes into ``view``."""
        ...
