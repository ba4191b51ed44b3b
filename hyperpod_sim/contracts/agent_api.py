"""The agent protocol's routes and bodies (docs/agent-protocol.md, docs/memory-tier.md).

Two APIs: the control plane's for agents, under ``/agent/v1`` (registration, heartbeats, policy
pulls, members, events, namespaces), and each agent's own (``/v1/policy`` for the control plane,
``/v1/cp/...`` and ``/v1/fast/...`` for trainers, ``/v1/internal/...`` between agents). Route
templates are written once here; the ``*_path`` functions fill them in, each path segment quoted.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar
from urllib.parse import quote, unquote

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from hyperpod_sim.contracts.agent_bodies import S3StatusError, S3TierStatus, parse_s3_status
from hyperpod_sim.contracts.limits import MAX_EVENT_MESSAGE, MAX_S3_STATUS_BYTES

#: The ``User-Agent`` prefix of the control plane's requests to agents (policy pushes, the
#: checkpoint listing's queries): what a NetworkPartition cuts off at the agent.
CONTROL_PLANE_AGENT = "hyperpod-sim-control-plane"

H = TypeVar("H")  # what a RouteTable binds each route to (the agent's handlers)

# ------------------------------------------------------------------ the control plane's, for agents

AGENT_API_PREFIX = "/agent/v1"
# An agent keeps its connection to the control plane open between heartbeats (a 1,024-node
# cluster's agents heartbeat every 16 s): a new connection per heartbeat cost the agent and serve
# about 1 ms of CPU each (measured at 64 nodes). serve keeps an idle connection longer than any
# agent does, so it is the agent that closes one, never serve while a request is on its way.
AGENT_KEEPALIVE_S = 60.0
SERVER_KEEPALIVE_S = 75.0
# The other way, the control plane holds a connection to each agent it pushes policies to, from the
# node's registration (a greeting: GET /health with the node's control-plane token) for as long as
# the node is pushed to: a push on a new connection cost the agent about 0.4 ms of CPU of 0.75 ms
# (measured), more once ksmd has merged its pages, and a rollout to 1,024 nodes is 1,024 pushes.
# An agent keeps a connection the control plane's token was checked on idle up to a day (others
# its server's 60 s); the control plane closes it when the node leaves.
AGENT_PUSH_IDLE_S = 86_400.0
REGISTER_ROUTE = "/clusters/{cluster}/register"
HEARTBEAT_ROUTE = "/clusters/{cluster}/nodes/{node_id}/heartbeat"
NODE_POLICY_ROUTE = "/clusters/{cluster}/nodes/{node_id}/policy"
MEMBERS_ROUTE = "/clusters/{cluster}/members"
EVENTS_ROUTE = "/clusters/{cluster}/events"
NAMESPACES_ROUTE = "/clusters/{cluster}/namespaces"
NAMESPACE_ROUTE = "/clusters/{cluster}/namespaces/{name}"
NAMESPACES_RESET_ROUTE = "/clusters/{cluster}/namespaces-reset"


@dataclass(frozen=True)
class S3StatusProblem:
    """A heartbeat's ``s3`` member that is not an S3TierStatus, and why (``message``)."""

    message: str


def read_s3_status(raw: object) -> S3TierStatus | S3StatusProblem | None:
    """The heartbeat's ``s3`` as received: the status, None, or what is wrong with it."""
    try:
        return parse_s3_status(raw)
    except S3StatusError as exc:
        return S3StatusProblem(str(exc))


def _s3_document(status: S3TierStatus | S3StatusProblem | None) -> dict[str, Any] | None:
    return status.document() if isinstance(status, S3TierStatus) else None


def _segment(value: object) -> str:
    return quote(str(value), safe="")


def agent_api_path(route: str, **parameters: object) -> str:
    """A path of the control plane's agent API: ``route`` (one of the ``*_ROUTE`` templates) with
    its parameters filled in, under ``/agent/v1``."""
    return AGENT_API_PREFIX + route.format(**{name: _segment(value) for name, value in parameters.items()})


if TYPE_CHECKING:
    S3Report = S3TierStatus | S3StatusProblem | None
else:
    # The value is typed (read_s3_status); the type FastAPI sees is Any, so the published schema
    # stays what it was (any JSON, described) and lists no model of its own for it.
    S3Report = Annotated[
        Any, PlainValidator(read_s3_status), PlainSerializer(_s3_document), WithJsonSchema({})
    ]


class Registration(BaseModel):
    """The body of ``POST /agent/v1/clusters/{cluster}/register``."""

    model_config = ConfigDict(frozen=True)

    node_id: str | None = Field(default=None, description="Null for agents of the external provisioner.")
    endpoint: str = Field(
        description="Where the control plane reaches the agent, e.g. http://127.0.0.1:41234",
        examples=["http://10.0.0.12:9200"],
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
    # Never refused here: a bad ``s3`` is a S3StatusProblem, which the domain answers in the
    # protocol's own words (400 InvalidS3Status), not as a malformed body.
    s3: S3Report = Field(
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

# Every route an agent serves is one row of AGENT_ROUTES below: the agent's router is built from
# them (agents/app.py, agents/tierroutes.py: one handler per row), so a path that is not a template
# here is not served; every caller fills a template in with ``agent_path``.
HEALTH_PATH = "/health"  # GET: open
METRICS_PATH = "/metrics"  # GET: open, the Prometheus text format
POLICY_PATH = "/v1/policy"  # PUT: the control plane's push (``?reset=true``: a re-sync); GET: open
CP_NAMESPACE_ROUTE = "/v1/cp/namespaces/{namespace}"
CP_LATEST_ROUTE = "/v1/cp/checkpoints/{namespace}/latest"
CP_SHARD_ROUTE = "/v1/cp/checkpoints/{namespace}/{rank}/{step}"
CP_RESET_ROUTE = "/v1/cp/cluster/reset"
FAST_RESERVE_ROUTE = "/v1/fast/reserve/{namespace}/{rank}/{step}"
FAST_COMMIT_ROUTE = "/v1/fast/commit/{token}"
FAST_ABORT_ROUTE = "/v1/fast/abort/{token}"
FAST_SHARD_ROUTE = "/v1/fast/shards/{namespace}/{rank}/{step}"
FAST_RELEASE_ROUTE = "/v1/fast/release/{lease}"
# The fast path's routes answer under this prefix too: /v1/cp/fast/... is /v1/fast/...
FAST_ALIAS_PREFIX = "/v1/cp"
INTERNAL_INDEX_ROUTE = "/v1/internal/index/{namespace}"
INTERNAL_S3_STEPS_ROUTE = "/v1/internal/s3-steps/{namespace}"
INTERNAL_SHARD_ROUTE = "/v1/internal/shards/{namespace}/{rank}/{step}"
INTERNAL_REPLICA_ROUTE = "/v1/internal/replicas/{namespace}/{rank}/{step}"  # PUT ``?owner=<node id>``
INTERNAL_PERSIST_ROUTE = "/v1/internal/persist/{namespace}/{step}"  # POST a PersistRequest
INTERNAL_NAMESPACE_ROUTE = "/v1/internal/namespaces/{namespace}"
INTERNAL_RESET_ROUTE = "/v1/internal/reset"
# The namespace index's homes (docs/memory-tier.md, "The namespace index"): PUT a ShardIndex (an
# agent's report of what it holds of the namespace), GET ``?num_ranks=N`` its complete steps
# (CatalogSteps) as the home sees them.
INTERNAL_CATALOG_ROUTE = "/v1/internal/catalog/{namespace}"
# GET ``[?rank=R]``: the nodes that hold the step (that rank of it, if named) as a home sees them.
INTERNAL_HOLDERS_ROUTE = "/v1/internal/holders/{namespace}/{step}"
# Of INTERNAL_CATALOG_ROUTE's GET (true: every member's image, CatalogImages; the control plane's
# checkpoint listing asks it)
IMAGES_PARAMETER = "images"
# How many agents keep a namespace's index (its homes): one may be down, the other answers.
NAMESPACE_HOMES = 2
# POST ``?save=<id>``: the step's metadata of that save is committed; drop every other save's shards.
INTERNAL_SAVES_ROUTE = "/v1/internal/saves/{namespace}/{step}"
# The query parameter of a shard read (GET CP_SHARD_ROUTE, INTERNAL_SHARD_ROUTE) that asks for the
# copy with this checksum only: a copy of another save of the step is not served (404).
CHECKSUM_PARAMETER = "checksum"
SAVE_PARAMETER = "save"  # of INTERNAL_SAVES_ROUTE and of FAST_COMMIT_ROUTE: the shard's save id
OWNER_PARAMETER = "owner"  # of INTERNAL_REPLICA_ROUTE: the node whose shard the replica is
# Of CP_LATEST_ROUTE (true: every world size, each named; the SDK asks it, never the library)
WORLD_SIZES_PARAMETER = "world_sizes"


def _home_weight(namespace: str, node_id: str) -> int:
    digest = hashlib.blake2b(f"{namespace}\x00{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def namespace_homes(namespace: str, node_ids: Iterable[str], count: int = NAMESPACE_HOMES) -> list[str]:
    """The agents that keep ``namespace``'s index: the ``count`` members (node ids of the cluster's
    member list, ``/agent/v1/clusters/{c}/members``) of highest weight for it (rendezvous hashing),
    best first. Every agent, and the control plane, compute the same homes from the same members,
    and a member joining or leaving moves only the namespaces whose homes it is or becomes."""
    return list(_ranked(namespace, frozenset(node_ids), count))


@functools.lru_cache(maxsize=4096)
def _ranked(namespace: str, node_ids: frozenset[str], count: int) -> tuple[str, ...]:
    """``namespace_homes``, remembered: every ``latest`` and read that misses asks for the homes,
    and hashing 1,024 members each time cost about a millisecond a call."""
    ranked = sorted(node_ids, key=lambda node_id: (_home_weight(namespace, node_id), node_id), reverse=True)
    return tuple(ranked[:count])


class AgentApi(StrEnum):
    """Which of an agent's APIs a route is part of: who calls it, and what it needs
    (docs/agent-protocol.md, "Agent API"; docs/memory-tier.md)."""

    ADMIN = "admin"  # health, metrics, the policy (its push: the control-plane token)
    LIBRARY = "library"  # /v1/cp: the library's protocol (writes: the checkpoint token under Token)
    FAST = "fast"  # /v1/fast: the same-host fast path (the checkpoint token under Token)
    INTERNAL = "internal"  # /v1/internal: agent to agent and the control plane (the cluster token)


@dataclass(frozen=True)
class AgentRoute:
    """One route of an agent: its method, its path template and the API it belongs to."""

    method: str
    template: str
    api: AgentApi

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.template.strip("/").split("/"))


def _routes(api: AgentApi, *rows: tuple[str, str]) -> tuple[AgentRoute, ...]:
    return tuple(AgentRoute(method, template, api) for method, template in rows)


AGENT_ROUTES: tuple[AgentRoute, ...] = (
    *_routes(
        AgentApi.ADMIN,
        ("GET", HEALTH_PATH),
        ("GET", POLICY_PATH),
        ("PUT", POLICY_PATH),
        ("GET", METRICS_PATH),
    ),
    *_routes(
        AgentApi.LIBRARY,
        ("GET", CP_NAMESPACE_ROUTE),
        ("POST", CP_NAMESPACE_ROUTE),
        ("DELETE", CP_NAMESPACE_ROUTE),
        ("GET", CP_LATEST_ROUTE),
        ("POST", CP_SHARD_ROUTE),
        ("GET", CP_SHARD_ROUTE),
        ("DELETE", CP_SHARD_ROUTE),
        ("POST", CP_RESET_ROUTE),
    ),
    *_routes(
        AgentApi.FAST,
        ("POST", FAST_RESERVE_ROUTE),
        ("POST", FAST_COMMIT_ROUTE),
        ("POST", FAST_ABORT_ROUTE),
        ("GET", FAST_SHARD_ROUTE),
        ("POST", FAST_RELEASE_ROUTE),
    ),
    *_routes(
        AgentApi.INTERNAL,
        ("GET", INTERNAL_INDEX_ROUTE),
        ("GET", INTERNAL_S3_STEPS_ROUTE),
        ("GET", INTERNAL_SHARD_ROUTE),
        ("DELETE", INTERNAL_SHARD_ROUTE),
        ("POST", INTERNAL_SAVES_ROUTE),
        ("PUT", INTERNAL_REPLICA_ROUTE),
        ("POST", INTERNAL_PERSIST_ROUTE),
        ("DELETE", INTERNAL_NAMESPACE_ROUTE),
        ("POST", INTERNAL_RESET_ROUTE),
        ("PUT", INTERNAL_CATALOG_ROUTE),
        ("GET", INTERNAL_CATALOG_ROUTE),
        ("GET", INTERNAL_HOLDERS_ROUTE),
    ),
)

_BY_KEY = {(route.method, route.template): route for route in AGENT_ROUTES}


def agent_route(method: str, template: str) -> AgentRoute:
    """The route of AGENT_ROUTES with this method and template; KeyError if there is none (a
    handler for it could never be reached)."""
    return _BY_KEY[(method, template)]


def agent_path(route: str, **parameters: object) -> str:
    """A path of an agent's own API: ``route`` (one of the templates above) filled in."""
    return route.format(**{name: _segment(value) for name, value in parameters.items()})


def _is_parameter(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


class _Node:
    __slots__ = ("fixed", "methods", "name", "parameter")

    def __init__(self) -> None:
        self.fixed: dict[str, _Node] = {}
        self.parameter: _Node | None = None
        self.name = ""
        self.methods: dict[str, Any] = {}


@dataclass(frozen=True)
class PathMatch(Generic[H]):
    """A path that one or more routes serve: what answers each method, and the path's parameters
    (their values unquoted)."""

    methods: Mapping[str, H]
    parameters: dict[str, str]


class RouteTable(Generic[H]):
    """The paths of AGENT_ROUTES (their templates), each route bound to what answers it, for the
    agent's server to look a request's path up in. Built from ``(route, handler)`` pairs: every
    route is a row of AGENT_ROUTES. A template's ``{name}`` matches one path segment (any text, an
    empty one too; unquoted); fixed segments win over a parameter. A path is looked up with its
    leading and trailing ``/`` stripped."""

    def __init__(self, handlers: Iterable[tuple[AgentRoute, H]]) -> None:
        self._root = _Node()
        for route, handler in handlers:
            if _BY_KEY.get((route.method, route.template)) != route:
                raise ValueError(f"{route.method} {route.template} is not a route of contracts.agent_api")
            segments = route.segments
            if route.api is AgentApi.FAST:
                self._add(segments, route.method, handler)
                alias = (*FAST_ALIAS_PREFIX.strip("/").split("/"), *segments[1:])
                self._add(alias, route.method, handler)
            else:
                self._add(segments, route.method, handler)

    def _add(self, segments: tuple[str, ...], method: str, handler: H) -> None:
        node = self._root
        for segment in segments:
            if _is_parameter(segment):
                if node.parameter is None:
                    node.parameter = _Node()
                    node.parameter.name = segment[1:-1]
                elif node.parameter.name != segment[1:-1]:
                    raise ValueError(
                        f"two parameter names at one place: {segment} and {{{node.parameter.name}}}"
                    )
                node = node.parameter
            else:
                node = node.fixed.setdefault(segment, _Node())
        if method in node.methods:
            raise ValueError(f"two handlers for {method} /{'/'.join(segments)}")
        node.methods[method] = handler

    def lookup(self, path: str) -> PathMatch[H] | None:
        """The routes of ``path``, or None if no template matches it."""
        parts = path.strip("/").split("/")
        parameters: dict[str, str] = {}
        node = self._walk(self._root, parts, 0, parameters)
        if node is None:
            return None
        return PathMatch(node.methods, parameters)

    def _walk(self, node: _Node, parts: list[str], at: int, parameters: dict[str, str]) -> _Node | None:
        if at == len(parts):
            return node if node.methods else None
        part = unquote(parts[at])
        fixed = node.fixed.get(part)
        if fixed is not None:
            found = self._walk(fixed, parts, at + 1, parameters)
            if found is not None:
                return found
        below = node.parameter
        if below is not None:
            found = self._walk(below, parts, at + 1, parameters)
            if found is not None:
                parameters[below.name] = part
                return found
        return None
