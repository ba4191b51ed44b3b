"""The memory tier's routes: ``/v1/cp/...`` (the library's protocol), ``/v1/fast/...`` (the same-host
fast path of our SDK) and ``/v1/internal/...`` (agent to agent, cluster token).

This module owns the HTTP side of the tier: it matches a request to a route and names the
credential the route needs (checked once, with the admin API's routes, by
:class:`agents.app.AgentApp`), reads the request's parameters and body, calls
:class:`agents.tier.MemoryTier` and turns what it returns (a document, a :class:`ShardCopy`) or
raises (:class:`TierError`) into the response.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

from hyperpod_sim.agents.access import checkpoint_credential
from hyperpod_sim.agents.httpserver import Request, Response, error_response, json_response
from hyperpod_sim.agents.numbers import canonical_int
from hyperpod_sim.agents.state import Credential
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.agents.tiermodel import (
    ShardCopy,
    TierError,
    checked_namespace,
    checked_new_namespace,
    parse_shard_meta,
)
from hyperpod_sim.contracts.shards import SHARD_META, TIER_HEADER, shard_meta

OCTETS = "application/octet-stream"

Answer = dict[str, Any] | list[int] | ShardCopy
Route = Callable[[Request], Awaitable[Response]]


def query_int(request: Request, parameter: str, *, default: int | None = None) -> int:
    """A query parameter's canonical integer value (its default when absent); TierError 400."""
    values = parse_qs(request.query, keep_blank_values=True).get(parameter)
    if not values:
        if default is None:
            raise TierError(400, "MissingParameter", f"the query parameter {parameter} is required")
        return default
    try:
        return canonical_int(values[0], what=parameter)
    except ValueError as exc:
        raise TierError(400, "InvalidParameter", str(exc)) from exc


def query_present(request: Request, parameter: str) -> bool:
    return parameter in parse_qs(request.query, keep_blank_values=True)


def query_flag(request: Request, parameter: str) -> bool:
    """A query parameter that is ``true`` or ``false`` (false when absent); TierError 400."""
    values = parse_qs(request.query, keep_blank_values=True).get(parameter)
    if not values:
        return False
    if values[0] not in ("true", "false"):
        raise TierError(400, "InvalidParameter", f"{parameter} is true or false")
    return values[0] == "true"


class BodyUpload:
    """A shard upload in a request: ``Shard-Meta`` names its checksum, ``Content-Length`` its size."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def checksum(self) -> str:
        return parse_shard_meta(self._request.headers.get(SHARD_META.lower()))

    def size(self) -> int:
        size = self._request.content_length
        if size is None:
            raise TierError(411, "LengthRequired", "a shard upload needs a Content-Length")
        return size

    async def fill(self, view: memoryview) -> None:
        await self._request.readinto(view)


def respond(answer: Answer, *, status: int = 200) -> Response:
    """The response carrying what the tier answered."""
    if isinstance(answer, ShardCopy):
        return Response(
            status=200,
            body=answer.body,
            content_type=OCTETS,
            headers=((SHARD_META, shard_meta(answer.checksum)), (TIER_HEADER, answer.tier)),
            on_sent=answer.on_sent,
        )
    return json_response(status, answer)


def refused(exc: TierError) -> Response:
    return error_response(exc.status, exc.error, exc.message, **exc.extra)


@dataclass(frozen=True)
class RouteMatch:
    """A route found for a request: what answers it, and the credential it needs (None: anyone).
    The one check of that credential is the agent app's (:class:`agents.app.AgentApp`)."""

    handler: Route
    credential: Credential | None


def _answering_errors(route: Route) -> Route:
    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except TierError as exc:
            return refused(exc)

    return answer


async def _tiering_off(request: Request) -> Response:
    return error_response(
        503,
        "TieredStorageDisabled",
        "tiered storage is off on this cluster (TieredStorageConfig Mode is not Enable, or "
        "this agent has no policy yet)",
    )


class TierRoutes:
    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    def match(self, request: Request) -> RouteMatch | None:
        """The tier route of a request, and who may call it; None if the path is not one of the
        tier's (the admin API's routes then)."""
        parts = [unquote(p) for p in request.path.strip("/").split("/")]
        state = self.tier.state
        if parts[:2] in (["v1", "cp"], ["v1", "fast"]):
            # /v1/cp/...: the library's protocol; /v1/fast/...: the same-host fast path of our SDK.
            # The fast path's routes answer under both prefixes: /v1/cp/fast/... is /v1/fast/...
            route_parts = parts[2:] if parts[1] == "cp" else parts[1:]
            route = self._public_route(request.method, route_parts)
            if route is None:
                return None
            if not state.tiered_storage_enabled:
                return RouteMatch(_tiering_off, None)
            # Writes, deletes and the fast path need the checkpoint token when AgentAccess is Token.
            fast_path = route_parts[:1] == ["fast"]
            return RouteMatch(
                _answering_errors(route), checkpoint_credential(state, request.method, fast_path=fast_path)
            )
        if parts[:2] == ["v1", "internal"]:
            route = self._internal_route(request.method, parts[2:])
            if route is None:
                return None
            return RouteMatch(_answering_errors(route), Credential.CLUSTER)  # the other agents, always
        return None

    def _public_route(self, method: str, parts: list[str]) -> Route | None:
        tier = self.tier
        match method, parts:
            case "GET", ["namespaces", name]:
                return lambda r: self._answer(tier.get_namespace(name))
            case "POST", ["namespaces", name]:
                return lambda r: self._create_namespace(name, r)
            case "DELETE", ["namespaces", name]:
                return lambda r: self._answer(tier.delete_namespace(name))
            case "GET", ["checkpoints", name, "latest"]:
                return lambda r: self._latest(name, r)
            case "POST", ["checkpoints", name, rank, step]:
                return lambda r: self._answer(tier.put_shard(name, rank, step, BodyUpload(r)))
            case "GET", ["checkpoints", name, rank, step]:
                return lambda r: self._answer(tier.get_shard(name, rank, step))
            case "DELETE", ["checkpoints", name, rank, step]:
                return lambda r: self._answer(tier.delete_shard(name, rank, step))
            case "POST", ["cluster", "reset"]:
                return lambda r: self._answer(tier.reset())
            case "POST", ["fast", "reserve", name, rank, step]:
                return lambda r: self._answer(
                    tier.fast_reserve(
                        name,
                        rank,
                        step,
                        size=lambda: query_int(r, "size"),
                        ahead=lambda: query_flag(r, "ahead"),
                    )
                )
            case "POST", ["fast", "commit", token]:
                return lambda r: self._answer(
                    tier.fast_commit(
                        token,
                        size=lambda reserved: query_int(r, "size", default=reserved),
                        step=lambda: query_int(r, "step") if query_present(r, "step") else None,
                    )
                )
            case "POST", ["fast", "abort", token]:
                return lambda r: self._now(lambda: tier.fast_abort(token))
            case "GET", ["fast", "shards", name, rank, step]:
                return lambda r: self._answer(tier.fast_locate(name, rank, step))
            case "POST", ["fast", "release", lease]:
                return lambda r: self._now(lambda: tier.fast_release(lease))
        return None

    def _internal_route(self, method: str, parts: list[str]) -> Route | None:
        tier = self.tier
        match method, parts:
            case "GET", ["index", name]:
                return lambda r: self._now(lambda: tier.local_index(name))
            case "GET", ["s3-steps", name]:
                return lambda r: self._answer(tier.local_s3_steps(name))
            case "GET", ["shards", name, rank, step]:
                return lambda r: self._answer(tier.local_shard(name, rank, step))
            case "PUT", ["replicas", name, rank, step]:
                return lambda r: self._put_replica(name, rank, step, r)
            case "POST", ["persist", name, step]:
                return lambda r: self._persist(name, step, r)
            case "DELETE", ["shards", name, rank, step]:
                return lambda r: self._now(lambda: tier.local_delete(name, rank, step))
            case "DELETE", ["namespaces", name]:
                return lambda r: self._now(lambda: tier.local_delete_namespace(name))
            case "POST", ["reset"]:
                return lambda r: self._now(tier.local_reset)
        return None

    # ------------------------------------------------------------------ requests read here

    @staticmethod
    async def _answer(answer: Awaitable[Answer], *, status: int = 200) -> Response:
        return respond(await answer, status=status)

    @staticmethod
    async def _now(answer: Callable[[], Answer]) -> Response:
        return respond(answer())

    async def _create_namespace(self, name: str, request: Request) -> Response:
        checked_new_namespace(name)
        num_ranks = query_int(request, "num_ranks")
        steps = query_int(request, "steps_retained", default=3)
        doc = await self.tier.create_namespace(name, num_ranks=num_ranks, steps_retained=steps)
        return respond(doc, status=201)

    async def _latest(self, name: str, request: Request) -> Response:
        checked_namespace(name)
        limit = query_int(request, "limit", default=5)
        return respond(await self.tier.latest(name, limit=limit))

    async def _put_replica(self, name: str, rank: str, step: str, request: Request) -> Response:
        owner = parse_qs(request.query).get("owner", [None])[0]
        return respond(await self.tier.put_replica(name, rank, step, BodyUpload(request), owner=owner))

    async def _persist(self, name: str, step: str, request: Request) -> Response:
        checked_namespace(name)
        try:
            number = canonical_int(step, what="step")
            body = json.loads(await request.read_body())
        except (ValueError, RecursionError) as exc:
            raise TierError(
                400, "InvalidPersist", f"a persist request needs a JSON body and a step: {str(exc)[:200]}"
            ) from exc
        return respond(await self.tier.persist(name, number, body))
