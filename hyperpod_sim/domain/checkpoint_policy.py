"""The per-cluster checkpoint policy: hyperpod-sim's extension of the cluster API (REST and SDK,
not the AWS JSON operations, whose shapes stay AWS's). Its wire shape, members and limits are
declared in the extensions model (hyperpod_sim/contracts/extensions.json), which the API validates requests
against before it builds a :class:`CheckpointPolicy`; what no shape can say (which members go
together) is checked here.

It says where and how often the agents persist complete steps to S3, how many persisted steps S3
keeps, how many steps the in-memory tier keeps, how many replicas each shard has, and who may
write to the agents' checkpoint routes (``AgentAccess``). Stored with the cluster, pushed to the
agents inside the versioned node policy (hyperpod_sim/domain/policy.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyperpod_sim.domain.errors import validation_error

DEFAULT_IN_MEMORY_RETENTION = 3
DEFAULT_REPLICATION_FACTOR = 1
# Open: the agents' /v1/cp routes serve anyone who reaches them, as HyperPod's daemon trusts its
# pod network (the amzn-sagemaker-checkpointing library sends no credentials). Token: writes and
# deletes on /v1/cp, and every /v1/fast route, need the cluster's checkpoint token.
DEFAULT_AGENT_ACCESS = "Open"


@dataclass(frozen=True)
class S3Endpoint:
    """Where the agents reach S3: a deployment setting (HPSIM_S3__*), not part of a cluster's
    policy, but handed to the agents inside it so that they need no S3 configuration of their own.
    ``url`` None: AWS's own endpoints."""

    url: str | None
    region: str


@dataclass(frozen=True)
class CheckpointPolicy:
    """A cluster's checkpoint policy. Building one checks which members go together (one
    ValidationException naming each rule broken); each member's own constraints are the model's."""

    s3_base_uri: str | None = None
    persist_every_steps: int | None = None
    persist_every_seconds: int | None = None
    s3_retention: int | None = None
    in_memory_retention: int = DEFAULT_IN_MEMORY_RETENTION
    replication_factor: int = DEFAULT_REPLICATION_FACTOR
    agent_access: str = DEFAULT_AGENT_ACCESS
    s3_layout: str | None = None  # None: the Default layout (contracts/s3layout.py)

    def __post_init__(self) -> None:
        errors = []
        persist = self.persist_every_steps is not None or self.persist_every_seconds is not None
        if self.s3_base_uri is not None and not persist:
            errors.append(
                "With S3BaseUri set, PersistEverySteps or PersistEverySeconds (or both) is required"
            )
        if self.s3_base_uri is None and (persist or self.s3_retention is not None):
            errors.append("PersistEverySteps, PersistEverySeconds and S3Retention need S3BaseUri")
        if self.s3_base_uri is None and self.s3_layout is not None:
            errors.append("S3Layout needs S3BaseUri")
        if errors:
            raise validation_error(errors)

    @classmethod
    def from_wire(cls, members: Mapping[str, Any]) -> CheckpointPolicy:
        """From the wire's members (checked against the model already); absent or null ones
        take their defaults."""
        given = {field: members.get(member) for member, field in _FIELDS.items()}
        return cls(**{field: value for field, value in given.items() if value is not None})

    @classmethod
    def from_stored(cls, stored: dict[str, Any] | None) -> CheckpointPolicy:
        """From the cluster's ``checkpoint_policy`` column (its wire shape; None: defaults)."""
        return cls.from_wire(stored or {})

    def to_wire(self) -> dict[str, Any]:
        wire = {member: getattr(self, field) for member, field in _FIELDS.items()}
        if wire["S3Layout"] is None:  # answered once set: the answers of before it existed stay as they were
            del wire["S3Layout"]
        return wire

    def access_document(self, checkpoint_token: str) -> dict[str, Any]:
        """The ``checkpoint_access`` member of a node policy. In Token mode it carries the
        SHA-256 of the cluster's checkpoint token, not the token: the agent can check a token
        with it, and nobody learns the token from a policy (an agent's ``GET /v1/policy`` is open)."""
        if self.agent_access != "Token":
            return {"mode": "Open"}
        return {"mode": "Token", "token_sha256": hashlib.sha256(checkpoint_token.encode()).hexdigest()}

    def s3_document(self, endpoint: S3Endpoint) -> dict[str, Any] | None:
        """The ``s3`` member of a node policy: None until a base URI is set."""
        if self.s3_base_uri is None:
            return None
        return {
            "base_uri": self.s3_base_uri,
            "persist_every_steps": self.persist_every_steps,
            "persist_every_seconds": self.persist_every_seconds,
            "retention": self.s3_retention,
            **({"layout": self.s3_layout} if self.s3_layout is not None else {}),
            "endpoint_url": endpoint.url,
            "region": endpoint.region,
        }


# Wire member -> field, in the model's member order.
_FIELDS = {
    "S3BaseUri": "s3_base_uri",
    "PersistEverySteps": "persist_every_steps",
    "PersistEverySeconds": "persist_every_seconds",
    "S3Retention": "s3_retention",
    "InMemoryRetention": "in_memory_retention",
    "ReplicationFactor": "replication_factor",
    "AgentAccess": "agent_access",
    "S3Layout": "s3_layout",
}
