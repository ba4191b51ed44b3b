"""The control plane's routes for node agents (docs/agent-protocol.md), under ``/agent/v1``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from hyperpod_sim.api.deps import ServicesDep
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

router = APIRouter(prefix=AGENT_API_PREFIX, tags=["agents"])


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
)
async def register(cluster: str, body: Registration, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(
        services.agents.register,
        cluster_name=cluster,
        token=bearer(request),
        node_id=body.node_id,
        endpoint=body.endpoint,
        pid=body.pid,
    )


@router.post(
    HEARTBEAT_ROUTE,
    summary="Agent heartbeat",
    description="With the node's own node token. Records liveness, the generation the agent applied "
    "and its S3 tier's status; answers the desired generation. 404 once the node is deleted "
    "(ShuttingDown included).",
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


@router.post(
    EVENTS_ROUTE,
    summary="Record an event of a node",
    description="What an agent reports for ListClusterEvents, e.g. the checkpoint steps it could not "
    "persist to S3 while draining: an event of the node whose node token the call carries. Accepted "
    'while the cluster is Deleting and the node ShuttingDown. Answers 201 {"event_id": ...}.',
    status_code=201,
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
)
async def policy(cluster: str, node_id: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.policy, cluster_name=cluster, node_id=node_id, token=bearer(request))


@router.get(
    MEMBERS_ROUTE,
    summary="The cluster's nodes in ring order",
    description="Node ids, groups, statuses and agent endpoints; agents resolve replica peers here.",
)
async def members(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.members, cluster_name=cluster, token=bearer(request))


@router.get(
    NAMESPACES_ROUTE,
    summary="The cluster's checkpoint namespaces",
    description="Every namespace trainers created through any agent of the cluster.",
)
async def list_namespaces(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.list_namespaces, cluster_name=cluster, token=bearer(request))


@router.get(
    NAMESPACE_ROUTE,
    summary="A checkpoint namespace",
    description="Namespaces are cluster-wide: agents keep them here, so that a namespace created "
    "through one agent is known to every agent of the cluster.",
)
async def get_namespace(cluster: str, name: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.get_namespace, cluster_name=cluster, token=bearer(request), name=name)


@router.post(
    NAMESPACE_ROUTE,
    summary="Create a checkpoint namespace",
    description="What an agent does when a trainer creates a namespace through it (409 if it exists). "
    "The retention is capped at the cluster's in-memory retention.",
    status_code=201,
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
)
async def delete_namespace(cluster: str, name: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(
        services.agents.delete_namespace, cluster_name=cluster, token=bearer(request), name=name
    )


@router.post(
    NAMESPACES_RESET_ROUTE,
    summary="Delete every namespace of the cluster",
    description="The control plane's half of the protocol's cluster reset.",
)
async def reset_namespaces(cluster: str, request: Request, services: ServicesDep) -> JSONResponse:
    return await _call(services.agents.reset_namespaces, cluster_name=cluster, token=bearer(request))
