"""The control plane's routes for node agents (docs/agent-protocol.md), under ``/agent/v1``."""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp, Receive, Scope, Send

from hyperpod_sim.api.deps import Services, ServicesDep
from hyperpod_sim.api.gate import replay, whole_body
from hyperpod_sim.contracts.agent_api import (
    AGENT_API_PREFIX,
    EVENTS_ROUTE,
    HEARTBEAT_ROUTE,
    MEMBERS_ROUTE,
    NAMESPACE_ROUTE,
    NAMESPACES_RESET_ROUTE,
    NAMESPACES_ROUTE,
    NODE_POLICY_ROUTE,
    REGISTER_ROUTE,
    AgentEvent,
    Heartbeat,
    NamespaceCreation,
    Registration,
)
from hyperpod_sim.domain.errors import AgentProtocolError


def _operation_id(route: APIRoute) -> str:
    """``Agent`` and the handler's name in CamelCase: AgentRegister, AgentListNamespaces, ..."""
    return "Agent" + "".join(word.capitalize() for word in route.name.split("_"))


router = APIRouter(prefix=AGENT_API_PREFIX, tags=["agents"], generate_unique_id_function=_operation_id)


# ---------------------------------------------------------------------- answers (documentation)
# The routes answer the domain's documents as they are (hyperpod_sim/domain/nodes/agents.py); these
# models only describe them in the OpenAPI document.


_POLICY = {
    "generation": 3,
    "cluster_name": "demo",
    "node_id": "i-0123456789abcdef0",
    "instance_group": "workers",
    "tiered_storage": {"enabled": True, "memory_percentage": 20},
    "in_memory_retention": 3,
}


class Registered(BaseModel):
    node_id: str = Field(examples=["i-0123456789abcdef0"])
    node_token: str = Field(
        examples=["3f1c..."], description="What the agent sends on its own calls from now on."
    )
    control_plane_token: str = Field(
        examples=["3f1c..."], description="What the control plane sends on its pushes to the agent."
    )
    cluster_token: str = Field(examples=["3f1c..."], description="For calls between the cluster's agents.")
    heartbeat_interval_s: float = Field(examples=[5.0])
    policy: dict[str, Any] = Field(
        description="The node's policy (docs/agent-protocol.md).", examples=[_POLICY]
    )


class HeartbeatAnswer(BaseModel):
    desired_generation: int = Field(examples=[3])
    push_pending: bool = Field(
        default=False,
        examples=[False],
        description="A push of desired_generation to this node is on its way (claimed, or due at "
        "the reconciler's next pass): the agent waits for it instead of pulling the policy (it "
        "pulls at a later heartbeat once a push failed).",
    )
    heartbeat_interval_s: float = Field(
        examples=[1.0],
        description="Seconds until the next heartbeat: the configured interval, longer past "
        "HPSIM_PROVISIONING__HEARTBEAT_FULL_RATE_NODES agents (docs/nodes.md, Heartbeats at scale).",
    )


class EventRecorded(BaseModel):
    event_id: str = Field(examples=["2f6c0d1e-8b3a-4c5d-9e7f-0a1b2c3d4e5f"])


class Member(BaseModel):
    node_id: str = Field(examples=["i-0123456789abcdef0"])
    instance_group: str = Field(examples=["workers"])
    status: str = Field(examples=["Running"])
    endpoint: str | None = Field(examples=["http://10.0.0.12:41234"])


class Members(BaseModel):
    members: list[Member]


class NamespaceDocument(BaseModel):
    namespace: str = Field(examples=["llama"])
    num_ranks: int = Field(examples=[3])
    steps_to_retain_per_rank: int = Field(examples=[3])


class Namespaces(BaseModel):
    namespaces: list[NamespaceDocument]


class NamespaceDeleted(BaseModel):
    deleted: str = Field(description="The namespace's name.", examples=["llama"])


class NamespacesReset(BaseModel):
    deleted: int = Field(description="How many namespaces were deleted.", examples=[2])


_NO_SLOT: dict[int | str, dict[str, Any]] = {
    409: {"description": "NoPendingSlot: every node slot of the cluster has an agent"}
}
_EXISTS: dict[int | str, dict[str, Any]] = {409: {"description": "NamespaceExists"}}


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _call(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> JSONResponse:
    try:
        return JSONResponse(await run_in_threadpool(lambda: fn(**kwargs)))
    except AgentProtocolError as exc:
        return JSONResponse(exc.to_body(), status_code=exc.status)
    except OperationalError as exc:  # the database is down: the agent retries later
        return JSONResponse(
            {
                "error": "ServiceUnavailable",
                "message": f"the control plane's database is unavailable: {exc.orig}",
            },
            status_code=503,
        )


async def _created(fn: Callable[..., dict[str, Any]], **kwargs: Any) -> JSONResponse:
    """:func:`_call` for a route that creates: its success is 201."""
    response = await _call(fn, **kwargs)
    if response.status_code == 200:
        response.status_code = 201
    return response


@router.post(
    REGISTER_ROUTE,
    summary="Register a node agent",
    description="With the node's launch secret and its node id (an agent the local provisioner "
    "started), or with the bootstrap token and no node id (external provisioner: the agent is bound "
    "to a pending node slot no agent holds). The endpoint must be http://HOST:PORT (a loopback "
    "host with the local provisioner). Answers the node id, the node's new node token and "
    "control-plane token, the cluster token (for calls between agents) and the node's policy.",
    response_model=Registered,
    responses=_NO_SLOT,
)
async def register(cluster: str, body: Registration, request: Request, services: ServicesDep) -> JSONResponse:
    admission = _registrations(request)
    if not admission.enter():
        return admission.refusal()
    try:
        return await _call(
            services.agents.register,
            cluster_name=cluster,
            token=bearer(request),
            node_id=body.node_id,
            endpoint=body.endpoint,
            pid=body.pid,
        )
    finally:
        admission.leave()


class Admission:
    """At most ``at_once`` registrations in the works; the others are answered at once, 503 with
    ``Retry-After``, without a database statement. A thousand agents started together otherwise
    queue behind each other on the database, time out, and retry into the queue, which a control
    plane of 1,024 nodes never came out of. The wait asked grows with the refusals of the last
    second (``per_second`` of them a second more), so retries spread as wide as the crowd."""

    def __init__(self, at_once: int, *, per_second: int = 32, longest_s: int = 30) -> None:
        self._at_once = at_once
        self._per_second = per_second
        self._longest_s = longest_s
        self._inside = 0
        self._refused: deque[float] = deque()
        self._lock = threading.Lock()

    def enter(self) -> bool:
        with self._lock:
            if self._inside >= self._at_once:
                now = time.monotonic()
                self._refused.append(now)
                while self._refused and self._refused[0] < now - 1.0:
                    self._refused.popleft()
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1

    def refusal(self) -> JSONResponse:
        with self._lock:
            wait_s = min(self._longest_s, 1 + len(self._refused) // self._per_second)
        return JSONResponse(
            {
                "error": "ServiceUnavailable",
                "message": f"the control plane is registering {self._at_once} agents; retry in {wait_s} s",
            },
            status_code=503,
            headers={"Retry-After": str(wait_s)},
        )


# Registrations in the works at once, per control plane: they run one at a time on the database
# anyway (each is a write transaction).
REGISTRATIONS_AT_ONCE = 8
_ADMISSION_LOCK = threading.Lock()


def _registrations(request: Request) -> Admission:
    """This control plane's (this app's) admission of registrations."""
    state = request.app.state
    with _ADMISSION_LOCK:
        if not hasattr(state, "registrations"):
            state.registrations = Admission(REGISTRATIONS_AT_ONCE)
        admission: Admission = state.registrations
        return admission


@router.post(
    HEARTBEAT_ROUTE,
    summary="Agent heartbeat",
    description="With the node's own node token. Records liveness, the generation the agent applied "
    "and its S3 tier's status; answers the desired generation. 404 once the node is deleted "
    "(ShuttingDown included).",
    response_model=HeartbeatAnswer,
)
async def heartbeat(
    cluster: str, node_id: str, body: Heartbeat, request: Request, services: ServicesDep
) -> JSONResponse:
    return await _call(
        services.agents.heartbeat,
        cluster_name=cluster,
        node_id=node_id,
        token=bearer(request),
        applied_generation=body.applied_generation,
        endpoint=body.endpoint,
        pid=body.pid,
        s3_status=body.s3,
    )


_HEARTBEAT_PATH = re.compile(
    "^"
    + re.escape(AGENT_API_PREFIX + HEARTBEAT_ROUTE)
    .replace(re.escape("{cluster}"), "(?P<cluster>[^/]+)")
    .replace(re.escape("{node_id}"), "(?P<node_id>[^/]+)")
    + "$"
)


class HeartbeatEntry:
    """The heartbeat route as a plain ASGI layer in front of FastAPI, as ``AwsJsonEntry`` is for the
    AWS JSON entry: the control plane's most frequent request (64 a second at 1,024 nodes), and
    FastAPI's routing and dependency resolution cost serve more than the heartbeat's own work
    (docs/nodes.md). It answers a well-formed heartbeat as the route does (``_call`` on the same
    domain call); anything else (another content type, a body that is not a valid ``Heartbeat``)
    goes on to the route, which answers it in its own words. It sits inside ``RequestGate``: the
    body's size and depth are checked before it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = None
        if scope["type"] == "http" and scope["method"] == "POST":
            found = _HEARTBEAT_PATH.match(scope["path"])
        if found is None or not _json_or_none(scope):
            await self.app(scope, receive, send)
            return
        body = await whole_body(receive)
        try:
            beat = Heartbeat.model_validate_json(body)
        except ValidationError:
            await self.app(scope, replay(body, receive), send)
            return
        request = Request(scope, receive)
        services: Services = scope["app"].state.services
        response = await _call(
            services.agents.heartbeat,
            cluster_name=found["cluster"],
            node_id=found["node_id"],
            token=bearer(request),
            applied_generation=beat.applied_generation,
            endpoint=beat.endpoint,
            pid=beat.pid,
            s3_status=beat.s3,
        )
        await response(scope, receive, send)


def _json_or_none(scope: Scope) -> bool:
    """Whether the request says its body is JSON, or says nothing (as FastAPI reads a model body)."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return True


@router.post(
    EVENTS_ROUTE,
    summary="Record an event of a node",
    description="What an agent reports for ListClusterEvents, e.g. the checkpoint steps it could not "
    "persist to S3 while draining: an event of the node whose node token the call carries. Accepted "
    'while the cluster is Deleting and the node ShuttingDown. Answers 201 {"event_id": ...}.',
    status_code=201,
    response_model=EventRecorded,
)
async def record_event(
    cluster: str, body: AgentEvent, request: Request, services: ServicesDep
) -> JSONResponse:
    return await _created(
        services.agents.record_event,
        cluster_name=cluster,
        node_id=body.node_id,
        token=bearer(request),
        level=body.level,
        message=body.message,
    )


@router.get(
    NODE_POLICY_ROUTE,
    summary="The node's current policy",
    description="What an agent pulls when its heartbeat says its generation is behind; with the "
    "node's own node token.",
    responses={200: {"content": {"application/json": {"schema": {"type": "object"}, "example": _POLICY}}}},
)
async def policy(cluster: str, node_id: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.policy, cluster_name=cluster, node_id=node_id, token=bearer(request))


@router.get(
    MEMBERS_ROUTE,
    summary="The cluster's nodes in ring order",
    description="Node ids, groups, statuses and agent endpoints; agents resolve replica peers here.",
    response_model=Members,
)
async def members(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.members, cluster_name=cluster, token=bearer(request))


@router.get(
    NAMESPACES_ROUTE,
    summary="The cluster's checkpoint namespaces",
    description="Every namespace trainers created through any agent of the cluster.",
    response_model=Namespaces,
)
async def list_namespaces(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.list_namespaces, cluster_name=cluster, token=bearer(request))


@router.get(
    NAMESPACE_ROUTE,
    summary="A checkpoint namespace",
    description="Namespaces are cluster-wide: agents keep them here, so that a namespace created "
    "through one agent is known to every agent of the cluster.",
    response_model=NamespaceDocument,
)
async def get_namespace(cluster: str, name: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.get_namespace, cluster_name=cluster, token=bearer(request), name=name)


@router.post(
    NAMESPACE_ROUTE,
    summary="Create a checkpoint namespace",
    description="What an agent does when a trainer creates a namespace through it (409 if it exists). "
    "The retention is capped at the cluster's in-memory retention. 400 ResourceLimitExceeded when the "
    "cluster holds HPSIM_LIMITS__MAX_NAMESPACES_PER_CLUSTER namespaces already, ValidationException "
    "for num_ranks outside 1..HPSIM_LIMITS__MAX_NAMESPACE_RANKS, InvalidNamespace for a name with a "
    "control character.",
    status_code=201,
    response_model=NamespaceDocument,
    responses=_EXISTS,
)
async def create_namespace(
    cluster: str, name: str, body: NamespaceCreation, request: Request, services: ServicesDep
) -> JSONResponse:
    return await _created(
        services.agents.create_namespace,
        cluster_name=cluster,
        token=bearer(request),
        name=name,
        num_ranks=body.num_ranks,
        steps_retained=body.steps_retained,
    )


@router.delete(
    NAMESPACE_ROUTE,
    summary="Delete a checkpoint namespace",
    description="The agent that received the trainer's delete then removes the data on every agent.",
    response_model=NamespaceDeleted,
)
async def delete_namespace(cluster: str, name: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(
        services.agents.delete_namespace, cluster_name=cluster, token=bearer(request), name=name
    )


@router.post(
    NAMESPACES_RESET_ROUTE,
    summary="Delete every namespace of the cluster",
    description="The control plane's half of the protocol's cluster reset.",
    response_model=NamespacesReset,
)
async def reset_namespaces(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.reset_namespaces, cluster_name=cluster, token=bearer(request))
