"""The node policy: the document the control plane pushes to each node's agent
(docs/agent-protocol.md, "Policy document").

The control plane builds a ``NodePolicy`` (domain/checkpoints/
node_policy.py); the agent validates what it receives
once, with ``parse_policy`` (agents/state.py), and both read attributes. On the wire it is JSON with
the snake_case members below; ``document()`` is that JSON, and for a policy parsed from a document
exactly the members it carried (members a newer control plane adds are kept and echoed, not read).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

# JSON numbers that may be integers: kept as they came, so a document echoes unchanged.
Number = StrictInt | StrictFloat
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_STRING = "a string or null"


class _Member(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class TieredStorage(_Member):
    enabled: StrictBool = False
    memory_percentage: StrictInt | None = None


class Peer(_Member):
    """A replica peer, by node id: agents look its endpoint up with the members call."""

    node_id: StrictStr


class Replication(_Member):
    factor: StrictInt = 0
    peers: tuple[Peer, ...] = ()


class S3Policy(_Member):
    """Where and how often the cluster's agents persist complete steps (CheckpointPolicy's S3 part)."""

    base_uri: StrictStr
    persist_every_steps: StrictInt | None = None
    persist_every_seconds: Number | None = None
    retention: StrictInt | None = None
    layout: StrictStr | None = None  # s3layout.LAYOUT_DEFAULT (None too) or LAYOUT_RAY
    endpoint_url: StrictStr | None = None
    region: StrictStr | None = None


class S3Fault(_Member):
    """An injected S3 fault the agent applies to its own S3 requests (hyperpod_sim/domain/faults.py)."""

    fault_id: StrictStr | None = None
    type: StrictStr
    latency_ms: Number | None = None
    error_rate: Number | None = None
    error_kind: StrictStr | None = None
    outage: StrictBool = False
    until: Number | None = None  # epoch seconds; past it the fault is over


class Faults(_Member):
    s3: S3Fault | None = None


class CheckpointAccess(_Member):
    """Who may write to the agent's checkpoint routes (the cluster's AgentAccess). In Token mode the
    policy carries the checkpoint token's SHA-256, never the token (``GET /v1/policy`` is open)."""

    mode: Literal["Open", "Token"] = "Open"
    token_sha256: StrictStr | None = None

    @model_validator(mode="after")
    def _digest_with_token(self) -> CheckpointAccess:
        if self.mode == "Token" and not (self.token_sha256 and _SHA256_HEX.fullmatch(self.token_sha256)):
            raise ValueError("Token mode needs a token_sha256 of 64 hex digits")
        return self

    @property
    def token_required(self) -> bool:
        return self.mode == "Token"


class NodePolicy(_Member):
    """One node's policy. ``generation`` orders them: an agent applies newer generations only
    (unless the control plane resets it). Every member but ``generation`` may be left out. Each
    member's description is what a refusal says it must be."""

    generation: Annotated[StrictInt, Field(ge=1, description="an integer >= 1")]
    cluster_name: Annotated[StrictStr | None, Field(description=_STRING)] = None
    cluster_id: Annotated[StrictStr | None, Field(description=_STRING)] = None
    node_id: Annotated[StrictStr | None, Field(description=_STRING)] = None
    instance_group: Annotated[StrictStr | None, Field(description=_STRING)] = None
    instance_type: Annotated[StrictStr | None, Field(description=_STRING)] = None
    tiered_storage: Annotated[TieredStorage, Field(description="an object with a boolean 'enabled'")] = (
        TieredStorage()
    )
    memory_budget_bytes: Annotated[StrictInt, Field(ge=0, description="an integer >= 0")] = 0
    in_memory_retention: Annotated[StrictInt | None, Field(description="an integer or null")] = None
    replication: Annotated[
        Replication, Field(description='an object {"factor": <integer>, "peers": [{"node_id": <string>}]}')
    ] = Replication()
    s3: Annotated[S3Policy | None, Field(description="an object with a string 'base_uri', or null")] = None
    faults: Annotated[Faults, Field(description="an object whose 's3' is an S3 fault or null")] = Faults()
    # Absent from an older control plane's policies: Open.
    checkpoint_access: Annotated[
        CheckpointAccess,
        Field(description='{"mode": "Open"} or {"mode": "Token", "token_sha256": <64 hex digits>}'),
    ] = CheckpointAccess()

    @property
    def peer_ids(self) -> list[str]:
        """The replica peers' node ids, in ring order."""
        return [peer.node_id for peer in self.replication.peers]

    def document(self) -> dict[str, Any]:
        """The wire document (JSON-ready): the members set, and only those."""
        return self.model_dump(mode="json", exclude_unset=True)

    def document_json(self) -> bytes:
        """``document()`` as JSON bytes, serialized by pydantic in one call (a push's body)."""
        return self.model_dump_json(exclude_unset=True).encode()


class PolicyError(ValueError):
    """A document that is not a node policy; the message says which member is wrong and how."""


def parse_policy(doc: object) -> NodePolicy:
    """Validate a received document, once. PolicyError names the first wrong member, what it must
    be and what it was (``'generation' must be an integer >= 1, got '3'``)."""
    if not isinstance(doc, dict):
        raise PolicyError(f"a policy document must be a JSON object, got {json_type(doc)}")
    try:
        return NodePolicy.model_validate(doc)
    except ValidationError as exc:
        member = str(exc.errors()[0]["loc"][0])
        what = NodePolicy.model_fields[member].description
        raise PolicyError(f"'{member}' must be {what}, got {repr(doc.get(member))[:200]}") from None


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
