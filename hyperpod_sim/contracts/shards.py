"""A shard's checksum and the ``Shard-Meta`` header that carries it (docs/memory-tier.md).

Every copy of a shard (a trainer's upload, a replica, an S3 object, a same-host read) is checked
against the base64 of its 16-byte xxh3_128 digest, the checksum amzn-sagemaker-checkpointing sends
in ``Shard-Meta: {"checksum": "...", "algorithm": "xxh3_128"}``. hyperpod-sim's SDK adds
``"save"``: the id of the save of the step the shard belongs to (``SAVE_ID``), which the step's
committed metadata names with each rank's checksum; the library sends none.
"""

from __future__ import annotations

import base64
import binascii
import json
import mmap
import re
from collections.abc import Iterable

import xxhash

ALGORITHM = "xxh3_128"
DIGEST_BYTES = 16
SHARD_META = "Shard-Meta"
# Which tier served a shard: memory (this node's own), replica, peer or s3.
TIER_HEADER = "X-Hpsim-Tier"

Bytes = bytes | bytearray | memoryview | mmap.mmap
# A save id: what the SDK's writer makes per save of a step (32 hex digits); 1 to 64 of these
# characters are accepted from any sender.
SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
SAVE_ID_RULE = "1 to 64 characters among letters, digits, '-' and '_'"


def checksum_of(data: Bytes) -> str:
    """base64 of the 16-byte xxh3_128 digest of ``data`` (the Shard-Meta checksum)."""
    return base64.b64encode(xxhash.xxh3_128_digest(data)).decode("ascii")


# What a step saved by a job of fewer ranks than its namespace holds keeps at the ranks that job
# did not have (between its last rank and the metadata, the namespace's last rank), so that every
# rank of the step is held: the SDK writes it, bound to the save like any shard. A step's world
# size is its lowest rank holding this (``step_world_size``); it is never read as a shard.
UNUSED_RANK = b"hpsim-unused-rank/1\n"


def step_world_size(num_ranks: int, unused: Iterable[int]) -> int:
    """The world size of the job that saved a step of a namespace of ``num_ranks`` ranks, the
    ranks holding ``UNUSED_RANK`` being ``unused``: the lowest of them, else the namespace's
    ranks less the metadata rank."""
    return min(unused, default=max(num_ranks - 1, 1))


class Checksum:
    """``checksum_of`` of bytes that come in pieces: ``update`` each, then ``text()``."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_128()

    def update(self, data: Bytes) -> None:
        self._hasher.update(data)

    def text(self) -> str:
        return base64.b64encode(self._hasher.digest()).decode("ascii")


UNUSED_RANK_CHECKSUM = checksum_of(UNUSED_RANK)


def shard_meta(checksum: str, save: str | None = None) -> str:
    """The ``Shard-Meta`` header of a shard with this checksum (and of this save, if given)."""
    doc = {"checksum": checksum, "algorithm": ALGORITHM}
    if save is not None:
        doc["save"] = save
    return json.dumps(doc)


class ShardMetaError(ValueError):
    """A ``Shard-Meta`` header that cannot be used; ``error`` is the code an agent answers with."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(message)
        self.error = error


def parse_shard_meta(header: str | None) -> str:
    """The base64 xxh3_128 checksum a ``Shard-Meta`` header carries; ShardMetaError (with the
    error code MissingShardMeta, InvalidShardMeta or UnsupportedAlgorithm) if it is not usable."""
    if not header:
        raise ShardMetaError("MissingShardMeta", "the Shard-Meta header (checksum of the shard) is required")
    try:
        meta = json.loads(header)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        checksum = meta["checksum"]
        algorithm = meta.get("algorithm", ALGORITHM)
        if len(base64.b64decode(checksum, validate=True)) != DIGEST_BYTES:
            raise ValueError("not a 16-byte digest")
    except (ValueError, KeyError, TypeError, RecursionError, binascii.Error) as exc:
        raise ShardMetaError(
            "InvalidShardMeta", f"the Shard-Meta header is not usable: {str(exc)[:200]}"
        ) from exc
    if algorithm != ALGORITHM:
        raise ShardMetaError("UnsupportedAlgorithm", f"checksum algorithm {algorithm!r}; only {ALGORITHM}")
    return str(checksum)


def parse_save(header: str | None) -> str | None:
    """The save id a ``Shard-Meta`` header carries (``"save"``), or None when it has none (the
    library's); ShardMetaError (InvalidShardMeta) if it is not a save id. Call it after
    ``parse_shard_meta`` has accepted the header."""
    if not header:
        return None
    try:
        meta = json.loads(header)
    except (ValueError, RecursionError):
        return None
    save = meta.get("save") if isinstance(meta, dict) else None
    if save is None:
        return None
    return checked_save(save, what="the Shard-Meta header's save")


def checked_save(save: object, *, what: str = "save") -> str:
    """``save`` if it is a save id; ShardMetaError (InvalidShardMeta) otherwise."""
    if not isinstance(save, str) or SAVE_ID.fullmatch(save) is None:
        raise ShardMetaError("InvalidShardMeta", f"{what} is not a save id ({SAVE_ID_RULE})")
    return save
