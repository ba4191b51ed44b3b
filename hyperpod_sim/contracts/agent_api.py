"""The agent protocol's routes and bodies (docs/agent-protocol.md, docs/memory-tier.md).

Two APIs: the control plane's for agents, under ``/agent/v1`` (registration, heartbeats, policy
pulls, members, events, namespaces), and each agent's own (``/v1/policy`` for the control plane,
``/v1/cp/...`` and ``/v1/fast/...`` for trainers, ``/v1/internal/...`` between agents). Route
templates are written once here; the ``*_path`` functions fill them in, each path segment quoted.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field

from hyperpod_sim.contracts.limits import MAX_EVENT_MESSAGE, MAX_S3_STATUS_BYTES

#: The ``User-Agent`` prefix of the control plane's requests to agents (policy pushes, the
#: checkpoint listing's queries): what a NetworkPartition cuts off at the agent.
CONTROL_PLANE_AGENT = "hyperpod-sim-control-plane"

# ------------------------------------------------------------------ the control plane's, for agents

AGENT_API_PREFIX = "/agent/v1"
REGISTER_ROUTE = "/clusters/{cluster}/register"
HEARTBEAT_ROUTE = "/clusters/{cluster}/nodes/{node_id}/heartbeat"
NODE_POLICY_ROUTE = "/clusters/{cluster}/nodes/{node_id}/policy"
MEMBERS_ROUTE = "/clusters/{cluster}/members"
EVENTS_ROUTE = "/clusters/{cluster}/events"
NAMESPACES_ROUTE = "/clusters/{cluster}/namespaces"
NAMESPACE_ROUTE = "/clusters/{cluster}/namespaces/{name}"
NAMESPACES_RESET_ROUTE = "/clusters/{cluster}/namespaces-reset"


def _segment(value: object) -> str:
    return quote(str(value), safe="")


def agent_api_path(route: str, **parameters: object) -> str:
    """A path of the control plane's agent API: ``route`` (one of the ``*_ROUTE`` templates) with
    its parameters filled in, under ``/agent/v1``."""
    return AGENT_API_PREFIX + route.format(**{name: _segment(value) for name, value in parameters.items()})


class Registration(BaseModel):
    """The body of ``POST /agent/v1/clusters/{cluster}/register``."""

    model_config = ConfigDict(frozen=True)

    node_id: str | None = Field(default=None, description="Null for agents of the external provisioner.")
    endpoint: str = Field(
        description="Where the control plane reaches the agent, e.g. http://127.0.0.1:41234",
        examples=["http://10.0.0.12:9000"],
    )
    pid: int | None = None
    instance_type: str | None = None
    memory_bytes: int | None = None


class Heartbeat(BaseModel):
    """The body of ``POST /agent/v1/clusters/{cluster}/nodes/{node_id}/heartbeat``."""

    model_config = ConfigDict(frozen=True)

    applied_generation: int = Field(ge=0)
    endpoint: str | None = None
    pid: int | None = None
    # Typed loosely on purpose: the domain checks it and answers in the protocol's own words.
    s3: Any = Field(
        default=None,
        description="The agent's S3 tier, shown as AgentStatus.S3Tier of the node: null, or "
        '{"pending_steps": int, "lag_seconds": float, "persisted_steps_total": int, '
        '"failures_total": int, "last_persisted": {"<namespace>": step}, "last_error": str | null}; '
        f"at most {MAX_S3_STATUS_BYTES // 1024} KiB of JSON.",
    )


class AgentEvent(BaseModel):
    """The body of ``POST /agent/v1/clusters/{cluster}/events``."""

    model_config = ConfigDict(frozen=True)

    node_id: str | None = Field(
        default=None,
        description="The reporting node, which must be the node whose token the call carries (the "
        "event is that node's in any case); a ShuttingDown node is accepted.",
    )
    level: Literal["Info", "Warn", "Error"]
    message: str = Field(min_length=1, max_length=MAX_EVENT_MESSAGE, description="The event's description.")


class NamespaceCreation(BaseModel):
    """The body of ``POST /agent/v1/clusters/{cluster}/namespaces/{name}``."""

    model_config = ConfigDict(frozen=True)

    num_ranks: int = Field(description="Ranks of the namespace, metadata ranks included.")
    steps_retained: int = Field(description="Steps kept per rank; capped at the cluster's retention.")


# ------------------------------------------------------------------ each agent's own

POLICY_PATH = "/v1/policy"  # PUT: the control plane's push (``?reset=true``: a re-sync); GET: open
CP_NAMESPACE_ROUTE = "/v1/cp/namespaces/{namespace}"
CP_LATEST_ROUTE = "/v1/cp/checkpoints/{namespace}/latest"
CP_SHARD_ROUTE = "/v1/cp/checkpoints/{namespace}/{rank}/{step}"
FAST_RESERVE_ROUTE = "/v1/fast/reserve/{namespace}/{rank}/{step}"
FAST_COMMIT_ROUTE = "/v1/fast/commit/{token}"
FAST_ABORT_ROUTE = "/v1/fast/abort/{token}"
FAST_SHARD_ROUTE = "/v1/fast/shards/{namespace}/{rank}/{step}"
FAST_RELEASE_ROUTE = "/v1/fast/release/{lease}"
INTERNAL_INDEX_ROUTE = "/v1/internal/index/{namespace}"
INTERNAL_S3_STEPS_ROUTE = "/v1/internal/s3-steps/{namespace}"


def agent_path(route: str, **parameters: object) -> str:
    """A path of an agent's own API: ``route`` (one of the templates above) filled in."""
    return route.format(**{name: _segment(value) for name, value in parameters.items()})
