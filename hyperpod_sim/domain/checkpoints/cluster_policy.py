"""The per-cluster checkpoint policy: hyperpod-sim's extension of the cluster API (REST and SDK,
not the AWS JSON operations, whose shapes stay AWS's). Its wire shape, members and limits are
declared in the extensions model (hyperpod_sim/contracts/simulator_api.json), which the API validates requests
against before it builds a :class:`CheckpointPolicy` (the typed value, models/groups.py); what no
shape can say (which members go together) is checked here, by :func:`check_members`.

It says where and how often the agents persist complete steps to S3, how many persisted steps S3
keeps, how many steps the in-memory tier keeps, how many replicas each shard has, and who may
write to the agents' checkpoint routes (``AgentAccess``). Stored with the cluster, pushed to the
agents inside the versioned node policy (hyperpod_sim/domain/checkpoints/node_policy.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from hyperpod_sim.domain.errors import validation_error
from hyperpod_sim.models.groups import CheckpointPolicy

__all__ = ["CheckpointPolicy", "S3Endpoint", "access_document", "check_members", "s3_document"]


@dataclass(frozen=True)
class S3Endpoint:
    """Where the agents reach S3: a deployment setting (HPSIM_S3__*), not part of a cluster's
    policy, but handed to the agents inside it so that they need no S3 configuration of their own.
    ``url`` None: AWS's own endpoints."""

    url: str | None
    region: str


def check_members(policy: CheckpointPolicy) -> None:
    """Check which members of the policy go together (one ValidationException naming each rule
    broken); each member's own constraints are the model's, checked by the API before."""
    errors = []
    persist = policy.persist_every_steps is not None or policy.persist_every_seconds is not None
    if policy.s3_base_uri is not None and not persist:
        errors.append("With S3BaseUri set, PersistEverySteps or PersistEverySeconds (or both) is required")
    if policy.s3_base_uri is None and (persist or policy.s3_retention is not None):
        errors.append("PersistEverySteps, PersistEverySeconds and S3Retention need S3BaseUri")
    if policy.s3_base_uri is None and policy.s3_layout is not None:
        errors.append("S3Layout needs S3BaseUri")
    if errors:
        raise validation_error(errors)


def access_document(policy: CheckpointPolicy, checkpoint_token: str) -> dict[str, Any]:
    """The ``checkpoint_access`` member of a node policy. In Token mode it carries the SHA-256 of
    the cluster's checkpoint token, not the token: the agent can check a token with it, and nobody
    learns the token from a policy (an agent's ``GET /v1/policy`` is open)."""
    if policy.agent_access != "Token":
        return {"mode": "Open"}
    return {"mode": "Token", "token_sha256": hashlib.sha256(checkpoint_token.encode()).hexdigest()}


def s3_document(policy: CheckpointPolicy, endpoint: S3Endpoint) -> dict[str, Any] | None:
    """The ``s3`` member of a node policy: None until a base URI is set."""
    if policy.s3_base_uri is None:
        return None
    return {
        "base_uri": policy.s3_base_uri,
        "persist_every_steps": policy.persist_every_steps,
        "persist_every_seconds": policy.persist_every_seconds,
        "retention": policy.s3_retention,
        **({"layout": policy.s3_layout} if policy.s3_layout is not None else {}),
        "endpoint_url": endpoint.url,
        "region": endpoint.region,
    }
