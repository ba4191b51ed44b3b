"""What the shard store stores and says: the key and info of a shard, its counters, its errors, the
checksum's canonical form (the checksum itself is :mod:`contracts.shards`'), and the rule for a
namespace's name. See :mod:`agents.store`."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

from hyperpod_sim.agents.numbers import echo
from hyperpod_sim.contracts.limits import MAX_NAME_BYTES
from hyperpod_sim.contracts.shards import DIGEST_BYTES

StepId = tuple[str, int]  # (namespace, step)
ProtectFn = Callable[[], AbstractSet[StepId]]


def nothing_protected() -> AbstractSet[StepId]:
    return frozenset()


@dataclass(frozen=True, order=True)
class ShardKey:
    namespace: str
    rank: int
    step: int


@dataclass(frozen=True)
class ShardInfo:
    key: ShardKey
    size: int
    # base64 of the 16-byte xxh3_128 digest, as amzn-sagemaker-checkpointing sends in Shard-Meta.
    checksum: str
    # None: this node's own (primary) shard; else the node id whose shard this is a replica of.
    replica_of: str | None
    path: Path  # the data file
    committed_at: float  # the store's clock at commit
    # The save of its step this shard belongs to (the SDK's save id, carried in Shard-Meta as
    # "save"); None for a shard sent without one (the library's).
    save: str | None = None


@dataclass
class StoreCounters:
    evictions_total: int = 0  # shards removed to make room (reserve, set_budget) or by retention
    # Uploads whose bytes did not match their checksum, and stored copies that failed verification.
    checksum_failures_total: int = 0
    bytes_written_total: int = 0  # bytes of committed shards


class BudgetExceeded(Exception):
    """No room for a shard within the memory budget (the HTTP layer answers 507); nothing was evicted."""

    def __init__(self, *, needed: int, budget: int, in_use: int, message: str | None = None) -> None:
        self.needed = needed
        self.budget = budget
        self.in_use = in_use
        default = f"cannot store {needed} bytes: the memory budget is {budget} bytes and {in_use} are in use"
        super().__init__(message or default)


class CorruptShard(Exception):
    """A shard's bytes do not match its checksum: an upload (nothing stored) or a stored copy (dropped)."""

    def __init__(self, key: ShardKey, *, detail: str) -> None:
        self.key = key
        super().__init__(f"rank {key.rank} step {key.step} of namespace {key.namespace!r}: {detail}")


class UnusableShardFile(Exception):
    """The file of a same-host write is not the one reserved any more (truncated, replaced, moved,
    linked): nothing is stored and the reservation is given back."""

    def __init__(self, key: ShardKey, *, detail: str) -> None:
        self.key = key
        super().__init__(
            f"the file reserved for rank {key.rank} step {key.step} of namespace {echo(key.namespace)} "
            f"cannot be committed: {detail}; nothing was stored"
        )


class ReservationCancelled(Exception):
    """The shard's namespace was deleted (or the store cleared) while it was being written."""

    def __init__(self, key: ShardKey) -> None:
        self.key = key
        super().__init__(
            f"rank {key.rank} step {key.step} of namespace {key.namespace!r} was being written when its "
            "namespace was deleted or the store cleared; nothing was stored"
        )


def normalized_checksum(checksum: str) -> str:
    """The canonical base64 form of a checksum; ValueError if it is not a 16-byte digest."""
    try:
        digest = base64.b64decode(checksum, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"checksum {checksum!r} is not base64: {exc}") from exc
    if len(digest) != DIGEST_BYTES:
        raise ValueError(
            f"checksum {checksum!r} is {len(digest)} bytes; an xxh3_128 digest is {DIGEST_BYTES}"
        )
    return base64.b64encode(digest).decode("ascii")


# ---------------------------------------------------------------------------------------- names on disk


def encode_namespace(namespace: str) -> str:
    return quote(namespace, safe="").replace(".", "%2E")


def decode_namespace(name: str) -> str | None:
    """The namespace a directory name stands for, or None if it is not one this store would write."""
    try:
        namespace = unquote(name, errors="strict")
    except UnicodeDecodeError:
        return None
    return namespace if namespace and encode_namespace(namespace) == name else None


def decimal(text: str) -> int | None:
    """The value of a canonical non-negative decimal ("7", not "07" or "+7"), else None."""
    if text.isascii() and text.isdigit() and str(int(text)) == text:
        return int(text)
    return None


def check_namespace(namespace: str) -> None:
    """ValueError unless a namespace of this name can be stored: not empty, and its directory name
    (percent-encoded UTF-8) at most 255 bytes."""
    if not namespace:
        raise ValueError("a namespace must not be empty")
    encoded = len(encode_namespace(namespace).encode())
    if encoded > MAX_NAME_BYTES:
        raise ValueError(
            f"namespace {echo(namespace)} is too long: {encoded} bytes once encoded for its directory name; "
            f"at most {MAX_NAME_BYTES} are allowed"
        )


def check_key(key: ShardKey) -> None:
    check_namespace(key.namespace)
    if key.rank < 0 or key.step < 0:
        raise ValueError(f"rank and step must not be negative (got rank {key.rank}, step {key.step})")
