"""The per-cluster checkpoint policy: hyperpod-sim's extension of the cluster API (REST and SDK,
not the AWS JSON operations, whose shapes stay AWS's).

It says where and how often the agents persist complete steps to S3, how many persisted steps S3
keeps, how many steps the in-memory tier keeps, how many replicas each shard has, and who may
write to the agents' checkpoint routes (``AgentAccess``). Stored with the cluster, pushed to the
agents inside the versioned node policy (domain/policy.py).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from domain.errors import echo, validation_error

DEFAULT_IN_MEMORY_RETENTION = 3
DEFAULT_REPLICATION_FACTOR = 1
MAX_IN_MEMORY_RETENTION = 100
MAX_REPLICATION_FACTOR = 3
# s3://bucket[/prefix]: bucket names as S3 allows them (3-63 of a-z 0-9 . -, alphanumeric ends).
S3_URI = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?")
# Open: the agents' /v1/cp routes serve anyone who reaches them, as HyperPod's daemon trusts its
# pod network (the amzn-sagemaker-checkpointing library sends no credentials). Token: writes and
# deletes on /v1/cp, and every /v1/fast route, need the cluster's checkpoint token.
AGENT_ACCESS_MODES = ("Open", "Token")
DEFAULT_AGENT_ACCESS = "Open"
MEMBERS = (
    "S3BaseUri",
    "PersistEverySteps",
    "PersistEverySeconds",
    "S3Retention",
    "InMemoryRetention",
    "ReplicationFactor",
    "AgentAccess",
)


@dataclass(frozen=True)
class S3Endpoint:
    """Where the agents reach S3: a deployment setting (HPSIM_S3__*), not part of a cluster's
    policy, but handed to the agents inside it so that they need no S3 configuration of their own.
    ``url`` None: AWS's own endpoints."""

    url: str | None
    region: str


@dataclass(frozen=True)
class CheckpointPolicy:
    s3_base_uri: str | None = None
    persist_every_steps: int | None = None
    persist_every_seconds: int | None = None
    s3_retention: int | None = None
    in_memory_retention: int = DEFAULT_IN_MEMORY_RETENTION
    replication_factor: int = DEFAULT_REPLICATION_FACTOR
    agent_access: str = DEFAULT_AGENT_ACCESS

    @classmethod
    def from_stored(cls, stored: dict[str, Any] | None) -> CheckpointPolicy:
        return parse_policy(stored or {})

    def to_wire(self) -> dict[str, Any]:
        return {
            "S3BaseUri": self.s3_base_uri,
            "PersistEverySteps": self.persist_every_steps,
            "PersistEverySeconds": self.persist_every_seconds,
            "S3Retention": self.s3_retention,
            "InMemoryRetention": self.in_memory_retention,
            "ReplicationFactor": self.replication_factor,
            "AgentAccess": self.agent_access,
        }

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
            "endpoint_url": endpoint.url,
            "region": endpoint.region,
        }


def _integer(
    body: dict[str, Any], member: str, errors: list[str], *, low: int, high: int | None = None
) -> int | None:
    value = body.get(member)
    if value is None:
        return None
    where = member[0].lower() + member[1:]
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(
            f"Value '{echo(value)}' at '{where}' failed to satisfy constraint: Member must be an integer"
        )
        return None
    if value < low:
        errors.append(
            f"Value '{echo(value)}' at '{where}' failed to satisfy constraint: "
            f"Member must have value greater than or equal to {low}"
        )
    elif high is not None and value > high:
        errors.append(
            f"Value '{echo(value)}' at '{where}' failed to satisfy constraint: "
            f"Member must have value less than or equal to {high}"
        )
    return value


def parse_policy(body: object) -> CheckpointPolicy:
    """Validate a policy body (all members optional; omitted ones take their defaults)."""
    if not isinstance(body, dict):
        raise validation_error(["The checkpoint policy must be a JSON object"])
    errors = [
        f"Unknown member '{key}': allowed members are {', '.join(MEMBERS)}"
        for key in body
        if key not in MEMBERS
    ]
    uri = body.get("S3BaseUri")
    if uri is not None and (not isinstance(uri, str) or len(uri) > 1024 or not S3_URI.fullmatch(uri)):
        errors.append(
            f"Value '{echo(uri)}' at 's3BaseUri' failed to satisfy constraint: Member must be an S3 URI "
            "s3://bucket[/prefix] with a valid bucket name"
        )
    steps = _integer(body, "PersistEverySteps", errors, low=1)
    seconds = _integer(body, "PersistEverySeconds", errors, low=1)
    s3_retention = _integer(body, "S3Retention", errors, low=1)
    memory = _integer(body, "InMemoryRetention", errors, low=1, high=MAX_IN_MEMORY_RETENTION)
    factor = _integer(body, "ReplicationFactor", errors, low=0, high=MAX_REPLICATION_FACTOR)
    access = body.get("AgentAccess")
    if access is not None and access not in AGENT_ACCESS_MODES:
        shown = access if isinstance(access, str) and len(access) <= 64 else f"{str(access)[:64]}..."
        errors.append(
            f"Value '{shown}' at 'agentAccess' failed to satisfy constraint: "
            f"Member must satisfy enum value set: [{', '.join(AGENT_ACCESS_MODES)}]"
        )
    if uri is not None and steps is None and seconds is None:
        errors.append("With S3BaseUri set, PersistEverySteps or PersistEverySeconds (or both) is required")
    if uri is None and (steps is not None or seconds is not None or s3_retention is not None):
        errors.append("PersistEverySteps, PersistEverySeconds and S3Retention need S3BaseUri")
    if errors:
        raise validation_error(errors)
    return CheckpointPolicy(
        s3_base_uri=uri,
        persist_every_steps=steps,
        persist_every_seconds=seconds,
        s3_retention=s3_retention,
        in_memory_retention=memory if memory is not None else DEFAULT_IN_MEMORY_RETENTION,
        replication_factor=factor if factor is not None else DEFAULT_REPLICATION_FACTOR,
        agent_access=access if isinstance(access, str) else DEFAULT_AGENT_ACCESS,
    )
