"""The JSON bodies of an agent's own API (docs/agent-protocol.md, docs/memory-tier.md), one frozen
model each: the sender builds one, the receiver validates what came once (``parse``) and reads
attributes, never keys. Shard data is raw bytes, never a model (``Shard-Meta`` names its checksum
and save, :mod:`contracts.shards`). Field order is the wire's member order.

The heartbeat's ``s3`` member (the S3 tier's status, which the control plane stores and shows as
``AgentStatus.S3Tier``) is :class:`S3TierStatus`, parsed by :func:`parse_s3_status` in the
protocol's own words.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr, ValidationError

from hyperpod_sim.contracts.limits import MAX_S3_STATUS_BYTES
from hyperpod_sim.contracts.shards import ALGORITHM

B = TypeVar("B", bound="AgentBody")


class AgentBody(BaseModel):
    """A JSON body of the agent API: frozen; members this side does not know are ignored (a newer
    peer may send more)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    @classmethod
    def parse(cls: type[B], raw: bytes | str) -> B:
        """The body received, validated; ``ValueError`` (a pydantic ValidationError) when it is
        not JSON or not this model."""
        return cls.model_validate_json(raw)

    def document(self) -> dict[str, Any]:
        """The body as JSON members, to send."""
        return self.model_dump(mode="json")


def problem_of(exc: ValidationError | ValueError) -> str:
    """A refused body's first problem, in a few words."""
    if isinstance(exc, ValidationError) and exc.errors():
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ())) or "body"
        return f"{where}: {error.get('msg', 'invalid')}"[:300]
    return str(exc)[:300]


# ------------------------------------------------------------------ /v1/cp: the library's protocol


class NamespaceAnswer(AgentBody):
    """``GET`` and ``POST /v1/cp/namespaces/{namespace}``."""

    namespace: str
    num_ranks: int
    steps_to_retain_per_rank: int


class ShardStored(AgentBody):
    """``POST /v1/cp/checkpoints/{namespace}/{rank}/{step}``: the shard is stored."""

    namespace: str
    rank: int
    step: int
    size: int


class RankStep(AgentBody):
    rank: int
    step: int


class ShardDeleted(AgentBody):
    """``DELETE /v1/cp/checkpoints/{namespace}/{rank}/{step}``."""

    deleted: RankStep


class NamespaceDeleted(AgentBody):
    """``DELETE /v1/cp/namespaces/{namespace}``."""

    deleted: str


class ResetDone(AgentBody):
    """``POST /v1/cp/cluster/reset`` and ``POST /v1/internal/reset``."""

    reset: bool = True


# ------------------------------------------------------------------ /v1/fast: the same-host fast path


class FastReservation(AgentBody):
    """``POST /v1/fast/reserve/{namespace}/{rank}/{step}?size=N[&ahead=true]``: a file in the agent's
    shared memory for the trainer to map and write; ``token`` commits or aborts it."""

    token: StrictStr
    path: StrictStr
    buffer_id: StrictStr
    size: int
    expires_in_s: float = 0.0


class SpareBuffer(AgentBody):
    """A file of the rank's rotation, for the trainer to map ahead of its next save."""

    path: StrictStr
    buffer_id: StrictStr
    size: int


class FastCommitted(AgentBody):
    """``POST /v1/fast/commit/{token}``: the written file is the shard (the agent hashed it)."""

    namespace: str
    rank: int
    step: int
    size: int
    checksum: str
    spares: tuple[SpareBuffer, ...] = ()


class FastAborted(AgentBody):
    """``POST /v1/fast/abort/{token}``."""

    aborted: bool


class FastLocation(AgentBody):
    """``GET /v1/fast/shards/{namespace}/{rank}/{step}``: where this node's copy is, leased
    (``POST /v1/fast/release/{lease}`` gives it back)."""

    path: StrictStr
    size: int
    checksum: StrictStr
    buffer_id: StrictStr
    tier: str = "memory"
    lease: StrictStr


class FastReleased(AgentBody):
    """``POST /v1/fast/release/{lease}``."""

    released: bool


# ------------------------------------------------------------------ /v1/internal: agent to agent


class ShardIndex(AgentBody):
    """``GET /v1/internal/index/{namespace}``: the copies one agent holds, step -> ranks: ``steps``
    every copy, ``primary`` the node's own shards, ``replica`` its copies of other nodes' shards,
    ``unused`` the copies that are ``shards.UNUSED_RANK`` (a step saved by fewer ranks than the
    namespace holds: its world size is its lowest such rank)."""

    node_id: str | None = None
    steps: dict[int, tuple[int, ...]]
    primary: dict[int, tuple[int, ...]] = {}
    replica: dict[int, tuple[int, ...]] = {}
    unused: dict[int, tuple[int, ...]] = {}
    # Increases with every index the agent makes (across its restarts too): a home keeps the
    # image with the highest, so an older one arriving late is ignored.
    seq: int = 0


class CatalogSteps(AgentBody):
    """``GET /v1/internal/catalog/{namespace}?num_ranks=N``: the complete steps of the namespace
    as a home of it sees them, newest first, each with the world size of the job that saved it."""

    steps: tuple[int, ...]
    world_sizes: dict[int, int]


class CatalogImages(AgentBody):
    """``GET /v1/internal/catalog/{namespace}?images=true``: every member's latest image of the
    namespace as a home keeps them (the control plane's checkpoint listing)."""

    images: tuple[ShardIndex, ...]


class CatalogReported(AgentBody):
    """``PUT /v1/internal/catalog/{namespace}``: whether the home kept the image (False: it held
    a newer one of that node already)."""

    kept: bool


class StepHolders(AgentBody):
    """``GET /v1/internal/holders/{namespace}/{step}[?rank=R]``: the nodes holding the step (that
    rank of it), as a home sees them: ``primary`` its own shards, ``replica`` copies of others'."""

    primary: tuple[str, ...]
    replica: tuple[str, ...]


class LatestSteps(AgentBody):
    """``GET /v1/cp/checkpoints/{namespace}/latest?limit=N&world_sizes=true``: the steps that can
    be loaded, newest first, whatever the world size of the job that saved each (``world_sizes``:
    step -> that world size). Without ``world_sizes=true`` (the library's request) the answer is
    the list of the steps saved at the namespace's own world size only."""

    steps: tuple[int, ...]
    world_sizes: dict[int, int]


class S3Steps(AgentBody):
    """``GET /v1/internal/s3-steps/{namespace}``: the steps on S3, newest first; ``trainer`` those
    the trainer wrote whole through the library (no commit marker); ``world_sizes`` each one's
    saving world size."""

    steps: tuple[int, ...]
    trainer: tuple[int, ...] = ()
    # step -> the world size of the job that saved it (from its marker; the namespace's for the
    # library's own writes), where it could be told.
    world_sizes: dict[int, int] = {}


class ReplicaStored(AgentBody):
    """``PUT /v1/internal/replicas/{namespace}/{rank}/{step}?owner=<node id>``."""

    size: int


class SavesDropped(AgentBody):
    """``POST /v1/internal/saves/{namespace}/{step}?save=<id>``: the shards of other saves of the
    step that this agent dropped."""

    dropped: tuple[RankStep, ...]


class PersistRequest(AgentBody):
    """``POST /v1/internal/persist/{namespace}/{step}``: upload the listed ranks of the step that
    the receiving agent holds (its own shards; any copy with ``replicas``; of save ``save`` if
    named) to ``base_uri``, which must be its own S3 target."""

    base_uri: str | None
    ranks: tuple[int, ...]
    replicas: bool = False
    save: str | None = None


class UploadedShard(AgentBody):
    """One shard as it is now on S3 (what a commit marker lists; ``contracts.s3layout.ShardObject``)."""

    rank: int
    key: str
    size: int
    checksum: str
    algorithm: str = ALGORITHM


class PersistAnswer(AgentBody):
    """The answer to a PersistRequest: what was uploaded, and why the rest was not."""

    uploaded: tuple[UploadedShard, ...] = ()
    failed: tuple[str, ...] = ()


class LocalDeleted(AgentBody):
    """``DELETE /v1/internal/shards/{namespace}/{rank}/{step}``."""

    deleted: bool = True


class LocalNamespaceDeleted(AgentBody):
    """``DELETE /v1/internal/namespaces/{namespace}``: how many shards this agent removed."""

    removed: int


# ------------------------------------------------------------------ admin


class PolicyApplied(AgentBody):
    """``PUT /v1/policy``: the generation in force now."""

    applied_generation: int


class AgentHealth(AgentBody):
    """``GET /health``."""

    status: str
    node_id: str | None
    cluster: str | None
    registered: bool
    applied_generation: int


# ------------------------------------------------------------------ the heartbeat's S3 status


class S3TierStatus(BaseModel):
    """The ``s3`` member of a heartbeat: the agent's S3 tier, shown as the node's
    ``AgentStatus.S3Tier``. Every member is optional on the wire (an older agent reports fewer);
    the agent sends them all. ``document()`` is what came, its known members only."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    pending_steps: StrictInt | None = None
    lag_seconds: StrictInt | StrictFloat | None = None
    persisted_steps_total: StrictInt | None = None
    failures_total: StrictInt | None = None
    last_persisted: dict[str, StrictInt] | None = None
    last_error: str | None = None

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class S3StatusError(ValueError):
    """A heartbeat's ``s3`` member that is not an S3TierStatus: the message says why."""


COUNTERS = ("pending_steps", "persisted_steps_total", "failures_total")


def _s3_problem(status: dict[str, Any]) -> str | None:
    for member in COUNTERS:
        value = status.get(member)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            return f"s3.{member} must be a non-negative integer, got {value!r}"
    lag = status.get("lag_seconds")
    if lag is not None and (
        isinstance(lag, bool) or not isinstance(lag, int | float) or not math.isfinite(lag) or lag < 0
    ):
        return f"s3.lag_seconds must be a non-negative number, got {lag!r}"
    persisted = status.get("last_persisted")
    if persisted is not None:
        if not isinstance(persisted, dict):
            return f"s3.last_persisted must be an object of namespace -> step, got {persisted!r}"
        for namespace, step in persisted.items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                return f"s3.last_persisted[{namespace!r}] must be a non-negative integer, got {step!r}"
    error = status.get("last_error")
    if error is not None and not isinstance(error, str):
        return f"s3.last_error must be a string or null, got {error!r}"
    return None


def parse_s3_status(raw: object) -> S3TierStatus | None:
    """A heartbeat's ``s3`` member as received (JSON values): None, or the status; S3StatusError
    when it is not an object or null, is over MAX_S3_STATUS_BYTES as JSON, or a known member has
    the wrong type. Members it does not know are ignored (a newer agent may report more)."""
    if raw is None:
        return None
    if isinstance(raw, S3TierStatus):
        return raw
    if not isinstance(raw, dict):
        raise S3StatusError(f"s3 must be an object or null, got {type(raw).__name__}.")
    size = len(json.dumps(raw, separators=(",", ":")).encode())
    if size > MAX_S3_STATUS_BYTES:
        raise S3StatusError(f"s3 is {size} bytes of JSON; at most {MAX_S3_STATUS_BYTES} are accepted.")
    problem = _s3_problem(raw)
    if problem is not None:
        raise S3StatusError(problem + ".")
    return S3TierStatus.model_validate(raw)
