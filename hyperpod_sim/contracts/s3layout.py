"""The S3 side of a checkpoint: where each object of a step goes, and the commit marker.

Layout under a base URI ``s3://bucket/prefix`` (the default layout of the public
``amzn-sagemaker-checkpointing`` library, so its S3 reader finds what the agents persisted)::

    prefix/<ns>/rank_<r>/step_<n>/checkpoint.pt       rank r's shard (r < world size)
    prefix/<ns>/rank_0/step_<n>/metadata.metadata     the metadata shard (in memory: rank world size)
    prefix/<ns>/_committed/step_<n>.json              the commit marker, written last

The library lists ``rank_<r>/`` prefixes only, so it never sees ``_committed/``. Under Ray Train the
library uses another layout by itself (its ``RayS3PathStrategy``), which the agents write too when
the checkpoint policy's ``S3Layout`` is ``Ray`` (the marker stays where it is)::

    prefix/<ns>/step_<n>/rank_<r>/checkpoint.pt
    prefix/<ns>/step_<n>/rank_0/metadata.metadata

The library's Ray reader lists ``step_<n>/`` prefixes, so it never sees ``_committed/`` either.

Each shard object carries its xxh3_128 (base64, as in ``Shard-Meta``) in the
``x-amz-meta-xxh3-128`` header. A step is on S3 once its marker is: the agents write it after
every shard.

A trainer that runs the library with ``save_to_s3=True`` writes either layout itself,
with no marker: each rank its ``checkpoint.pt``, then the coordinator ``rank_0/.../metadata.metadata``
(after every rank's write returned). Such a step is on S3 too, **written by the trainer**, when the
library's own reader would take it (``library_steps``, ``trainer_steps``): every rank
``0..world_size-1`` has its object and the metadata is there. Its objects carry no checksum.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hyperpod_sim.contracts.policy import S3Policy
from hyperpod_sim.contracts.shards import ALGORITHM, UNUSED_RANK_CHECKSUM, step_world_size

CHECKSUM_META = "xxh3-128"  # the object metadata key of a shard's checksum
MARKER_DIR = "_committed"
MARKER_FORMAT = "hyperpod-sim/commit-marker"
MARKER_VERSION = 1
DEFAULT_REGION = "us-east-1"
_STEP_IN_KEY = re.compile(r"/step_(\d+)(?:/|\.json$)")
SHARD_FILE = "checkpoint.pt"  # the library's names of a rank's shard and of the metadata
METADATA_FILE = "metadata.metadata"
WRITTEN_BY_AGENTS = "Agents"  # who put a step on S3: the agents (a marker) or the trainer (the library)
WRITTEN_BY_TRAINER = "Trainer"
LAYOUT_DEFAULT = "Default"  # the library's DefaultS3PathStrategy: rank_<r>/step_<n>/
LAYOUT_RAY = "Ray"  # its RayS3PathStrategy: step_<n>/rank_<r>/
LAYOUTS = (LAYOUT_DEFAULT, LAYOUT_RAY)
_LIBRARY_OBJECT = {
    LAYOUT_DEFAULT: re.compile(
        r"rank_(?P<rank>\d+)/step_(?P<step>\d+)/(?P<file>checkpoint\.pt|metadata\.metadata)"
    ),
    LAYOUT_RAY: re.compile(
        r"step_(?P<step>\d+)/rank_(?P<rank>\d+)/(?P<file>checkpoint\.pt|metadata\.metadata)"
    ),
}


@dataclass(frozen=True)
class S3Target:
    """Where and how often a cluster's agents persist, from the ``s3`` member of a node policy."""

    base_uri: str
    bucket: str
    prefix: str  # without leading or trailing "/"; "" for the bucket's root
    endpoint_url: str | None
    region: str
    every_steps: int | None
    every_seconds: float | None
    retention: int | None
    layout: str = LAYOUT_DEFAULT  # where the agents put shards: LAYOUT_DEFAULT or LAYOUT_RAY

    @classmethod
    def from_policy(cls, s3: S3Policy | None, *, endpoint_override: str | None = None) -> S3Target | None:
        """The target a policy names, or None (no S3 persistence). ValueError if its base URI is
        not an S3 URI with a bucket."""
        if s3 is None:
            return None
        uri = s3.base_uri
        if not uri.startswith("s3://"):
            raise ValueError(f"the S3 base URI must start with s3://, got {uri!r}")
        bucket, _, prefix = uri[5:].partition("/")
        if not bucket:
            raise ValueError(f"the S3 base URI {uri!r} names no bucket")
        steps, seconds, retention = s3.persist_every_steps, s3.persist_every_seconds, s3.retention
        return cls(
            base_uri=uri.rstrip("/"),
            bucket=bucket,
            prefix=prefix.strip("/"),
            endpoint_url=endpoint_override or s3.endpoint_url or None,
            region=s3.region or DEFAULT_REGION,
            every_steps=steps or None,
            every_seconds=float(seconds) if seconds else None,
            retention=retention or None,
            layout=s3.layout or LAYOUT_DEFAULT,
        )

    @classmethod
    def from_uri(cls, base_uri: str) -> S3Target:
        """The target of a bare base URI (a trainer reading S3 directly); ValueError if not one."""
        target = cls.from_policy(S3Policy(base_uri=base_uri))
        assert target is not None
        return target

    def namespace_prefix(self, namespace: str) -> str:
        return f"{self.prefix}/{namespace}/" if self.prefix else f"{namespace}/"

    def shard_key(
        self, namespace: str, rank: int, step: int, num_ranks: int, *, layout: str | None = None
    ) -> str:
        """The object of one shard, in ``layout`` (default: the target's). The metadata shard is
        the last rank of a namespace of at least two ranks (the library's convention:
        ``num_ranks = world_size + 1``)."""
        base = self.namespace_prefix(namespace)
        rank, name = (0, METADATA_FILE) if num_ranks >= 2 and rank == num_ranks - 1 else (rank, SHARD_FILE)
        if (layout or self.layout) == LAYOUT_RAY:
            return f"{base}step_{step}/rank_{rank}/{name}"
        return f"{base}rank_{rank}/step_{step}/{name}"

    def marker_prefix(self, namespace: str) -> str:
        return f"{self.namespace_prefix(namespace)}{MARKER_DIR}/"

    def marker_key(self, namespace: str, step: int) -> str:
        return f"{self.marker_prefix(namespace)}step_{step}.json"


@dataclass(frozen=True)
class ShardObject:
    """One shard as it is on S3 (what a commit marker lists)."""

    rank: int
    key: str
    size: int
    checksum: str

    def doc(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "key": self.key,
            "size": self.size,
            "checksum": self.checksum,
            "algorithm": ALGORITHM,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> ShardObject:
        return cls(int(doc["rank"]), str(doc["key"]), int(doc["size"]), str(doc["checksum"]))


@dataclass(frozen=True)
class CommitMarker:
    """The object that makes a step visible on S3, written after all of its shards."""

    namespace: str
    step: int
    num_ranks: int
    committed_at: float  # epoch seconds
    committed_by: str | None  # the node id of the agent that wrote it
    shards: tuple[ShardObject, ...]
    # The save of the step whose shards these are (the SDK's save id, as the step's metadata
    # names it); None for shards saved without one (the library's).
    save: str | None = None

    def doc(self) -> dict[str, Any]:
        return {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "namespace": self.namespace,
            "step": self.step,
            "num_ranks": self.num_ranks,
            "committed_at": self.committed_at,
            "committed_by": self.committed_by,
            "shards": [shard.doc() for shard in self.shards],
            "save": self.save,
        }

    @staticmethod
    def save_of(raw: bytes) -> str | None:
        """The save a marker's bytes name (None: none, a marker of an earlier version); ValueError,
        KeyError or TypeError if they are not a marker."""
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc["shards"], list):
            raise TypeError("not a commit marker")
        save = doc.get("save")
        return None if save is None else str(save)

    @staticmethod
    def world_size_of(raw: bytes) -> int:
        """The world size of the job that saved the step a marker's bytes commit (its lowest rank
        holding ``shards.UNUSED_RANK``, else its ranks less the metadata rank); ValueError,
        KeyError or TypeError if they are not a marker."""
        doc = json.loads(raw)
        unused = (int(d["rank"]) for d in doc["shards"] if d["checksum"] == UNUSED_RANK_CHECKSUM)
        return step_world_size(int(doc["num_ranks"]), unused)

    @staticmethod
    def shard_of(raw: bytes, rank: int) -> ShardObject | None:
        """The object of ``rank`` that a marker's bytes list, or None; ValueError, KeyError or
        TypeError if they are not a marker."""
        doc = json.loads(raw)
        return next((ShardObject.from_doc(d) for d in doc["shards"] if d["rank"] == rank), None)


def step_of_key(key: str) -> int | None:
    """The step an object of the layout belongs to, or None."""
    match = _STEP_IN_KEY.search(key)
    return int(match.group(1)) if match else None


def library_steps(
    keys: Iterable[str], namespace_prefix: str, world_size: int | None, layout: str = LAYOUT_DEFAULT
) -> list[int]:
    """The steps that the library wrote completely, newest first, from the object keys under a
    namespace's prefix: as the library's reader decides (its ``find_step_ranks``: every rank
    ``0..world_size-1`` present), with the objects themselves required (each rank's
    ``checkpoint.pt`` and ``rank_0``'s ``metadata.metadata``, written last). ``world_size`` None (a
    namespace the control plane does not know): the ranks present must be ``0..k-1``, which the
    metadata, written only after every rank's shard, vouches for. ``layout``: which of the
    library's two layouts to look for."""
    pattern = _LIBRARY_OBJECT[layout]
    shards: dict[int, set[int]] = {}
    metadata: set[int] = set()
    for key in keys:
        if not key.startswith(namespace_prefix):
            continue
        match = pattern.fullmatch(key[len(namespace_prefix) :])
        if match is None:
            continue
        rank, step = int(match["rank"]), int(match["step"])
        if match["file"] == SHARD_FILE:
            shards.setdefault(step, set()).add(rank)
        elif rank == 0:
            metadata.add(step)
    complete = []
    for step in metadata:
        ranks = shards.get(step, set())
        wanted = set(range(world_size if world_size is not None else len(ranks)))
        if ranks and wanted <= ranks and (world_size is not None or ranks == wanted):
            complete.append(step)
    return sorted(complete, reverse=True)


def trainer_steps(keys: Iterable[str], namespace_prefix: str, world_size: int | None) -> dict[int, str]:
    """The steps the library wrote completely in either of its layouts -> that layout (the
    default one where a step is complete in both)."""
    listed = list(keys)
    found = {step: LAYOUT_RAY for step in library_steps(listed, namespace_prefix, world_size, LAYOUT_RAY)}
    found.update(
        (step, LAYOUT_DEFAULT) for step in library_steps(listed, namespace_prefix, world_size, LAYOUT_DEFAULT)
    )
    return found
