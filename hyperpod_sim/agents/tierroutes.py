"""The memory tier's routes: ``/v1/cp/...`` (the library's protocol), ``/v1/fast/...`` (the same-host
fast path of our SDK) and ``/v1/internal/...`` (agent to agent, cluster token).

This module owns the HTTP side of the tier: one handler per route of
``contracts.agent_api.AGENT_ROUTES`` (``TierRoutes.handlers``; :class:`agents.app.AgentApp` builds
the agent's one route table from them and the admin API's, and checks each route's credential
once), which reads the request's parameters and body, calls :class:`agents.tier.MemoryTier` and
turns what it returns (a body model of ``contracts.agent_bodies``, a :class:`ShardCopy`) or
raises (:class:`TierError`) into the response.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import parse_qs

from hyperpod_sim.agents.http.server import Request, Response, error_response, json_response
from hyperpod_sim.agents.numbers import canonical_int
from hyperpod_sim.agents.store.keys import normalized_checksum
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.agents.tiermodel import (
    ShardCopy,
    TierError,
    checked_namespace,
    checked_new_namespace,
    parse_save_id,
    parse_shard_meta,
    parse_shard_save,
)
from hyperpod_sim.contracts.agent_api import (
    CHECKSUM_PARAMETER,
    CP_LATEST_ROUTE,
    CP_NAMESPACE_ROUTE,
    CP_RESET_ROUTE,
    CP_SHARD_ROUTE,
    FAST_ABORT_ROUTE,
    FAST_COMMIT_ROUTE,
    FAST_RELEASE_ROUTE,
    FAST_RESERVE_ROUTE,
    FAST_SHARD_ROUTE,
    IMAGES_PARAMETER,
    INTERNAL_CATALOG_ROUTE,
    INTERNAL_HOLDERS_ROUTE,
    INTERNAL_INDEX_ROUTE,
    INTERNAL_NAMESPACE_ROUTE,
    INTERNAL_PERSIST_ROUTE,
    INTERNAL_REPLICA_ROUTE,
    INTERNAL_RESET_ROUTE,
    INTERNAL_S3_STEPS_ROUTE,
    INTERNAL_SAVES_ROUTE,
    INTERNAL_SHARD_ROUTE,
    OWNER_PARAMETER,
    SAVE_PARAMETER,
    WORLD_SIZES_PARAMETER,
    AgentRoute,
    agent_route,
)
from hyperpod_sim.contracts.agent_bodies import AgentBody, PersistRequest, problem_of
from hyperpod_sim.contracts.shards import SHARD_META, TIER_HEADER, shard_meta

OCTETS = "application/octet-stream"

Answer = AgentBody | list[int] | ShardCopy
Parameters = Mapping[str, str]  # a path's parameters, by their names in the route's template
# What answers one route: the request and its path's parameters.
Handler = Callable[[Request, Parameters], Awaitable[Response]]


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


def query_checksum(request: Request) -> str | None:
    """The ``checksum`` a shard read asks for (only the copy with it is served), or None; a
    TierError 400 if it is not a checksum."""
    values = parse_qs(request.query, keep_blank_values=True).get(CHECKSUM_PARAMETER)
    if not values:
        return None
    try:
        return normalized_checksum(values[0])
    except ValueError as exc:
        raise TierError(400, "InvalidParameter", f"{CHECKSUM_PARAMETER}: {exc}") from exc


def query_save(request: Request) -> str | None:
    """The ``save`` id a request names, or None; a TierError 400 if it is not one."""
    values = parse_qs(request.query, keep_blank_values=True).get(SAVE_PARAMETER)
    return parse_save_id(values[0], what=SAVE_PARAMETER) if values else None


def required_save(request: Request) -> str:
    """The ``save`` id a request must name; a TierError 400 if it is missing or not one."""
    save = query_save(request)
    if save is None:
        raise TierError(400, "MissingParameter", f"the query parameter {SAVE_PARAMETER} is required")
    return save


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

    def save(self) -> str | None:
        return parse_shard_save(self._request.headers.get(SHARD_META.lower()))

    def size(self) -> int:
        size = self._request.content_length
        if size is None:
            raise TierError(411, "LengthRequired", "a shard upload needs a Content-Length")
        return size

    async def fill(self, view: memoryview) -> None:
        await self._request.readinto(view)


def respond(answer: Answer, *, status: int = 200) -> Response:
    """The response carrying what the tier answered: a shard's bytes as they are, a body model as
    its JSON document."""
    if isinstance(answer, ShardCopy):
        return Response(
            status=200,
            body=answer.body,
            content_type=OCTETS,
            headers=((SHARD_META, shard_meta(answer.checksum, answer.save)), (TIER_HEADER, answer.tier)),
            on_sent=answer.on_sent,
        )
    return json_response(status, answer if isinstance(answer, list) else answer.document())


def refused(exc: TierError) -> Response:
    return error_response(exc.status, exc.error, exc.message, **exc.extra)


async def tiering_off(request: Request) -> Response:
    return error_response(
        503,
        "TieredStorageDisabled",
        "tiered storage is off on this cluster (TieredStorageConfig Mode is not Enable, or "
        "this agent has no policy yet)",
    )


class TierRoutes:
    """The tier's rows of ``contracts.agent_api.AGENT_ROUTES``, each bound to its handler."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    def handlers(self) -> list[tuple[AgentRoute, Handler]]:
        """One handler per route of the library's protocol, the fast path and the internal API."""
        tier = self.tier
        table: dict[tuple[str, str], Handler] = {
            # /v1/cp: the library's protocol
            ("GET", CP_NAMESPACE_ROUTE): lambda r, p: self._answer(tier.get_namespace(p["namespace"])),
            ("POST", CP_NAMESPACE_ROUTE): self._create_namespace,
            ("DELETE", CP_NAMESPACE_ROUTE): lambda r, p: self._answer(tier.delete_namespace(p["namespace"])),
            ("GET", CP_LATEST_ROUTE): self._latest,
            ("POST", CP_SHARD_ROUTE): lambda r, p: self._answer(
                tier.put_shard(p["namespace"], p["rank"], p["step"], BodyUpload(r))
            ),
            ("GET", CP_SHARD_ROUTE): lambda r, p: self._answer(
                tier.get_shard(p["namespace"], p["rank"], p["step"], checksum=query_checksum(r))
            ),
            ("DELETE", CP_SHARD_ROUTE): lambda r, p: self._answer(
                tier.delete_shard(p["namespace"], p["rank"], p["step"])
            ),
            ("POST", CP_RESET_ROUTE): lambda r, p: self._answer(tier.reset()),
            # /v1/fast (and /v1/cp/fast): the same-host fast path of our SDK
            ("POST", FAST_RESERVE_ROUTE): lambda r, p: self._answer(
                tier.fast_reserve(
                    p["namespace"],
                    p["rank"],
                    p["step"],
                    size=lambda: query_int(r, "size"),
                    ahead=lambda: query_flag(r, "ahead"),
                )
            ),
            ("POST", FAST_COMMIT_ROUTE): lambda r, p: self._answer(
                tier.fast_commit(
                    p["token"],
                    size=lambda reserved: query_int(r, "size", default=reserved),
                    step=lambda: query_int(r, "step") if query_present(r, "step") else None,
                    save=lambda: query_save(r),
                )
            ),
            ("POST", FAST_ABORT_ROUTE): lambda r, p: self._now(lambda: tier.fast_abort(p["token"])),
            ("GET", FAST_SHARD_ROUTE): lambda r, p: self._answer(
                tier.fast_locate(p["namespace"], p["rank"], p["step"])
            ),
            ("POST", FAST_RELEASE_ROUTE): lambda r, p: self._now(lambda: tier.fast_release(p["lease"])),
            # /v1/internal: the other agents and the control plane, with the cluster token
            ("GET", INTERNAL_INDEX_ROUTE): lambda r, p: self._now(lambda: tier.local_index(p["namespace"])),
            ("GET", INTERNAL_S3_STEPS_ROUTE): lambda r, p: self._answer(tier.local_s3_steps(p["namespace"])),
            ("GET", INTERNAL_SHARD_ROUTE): lambda r, p: self._answer(
                tier.local_shard(p["namespace"], p["rank"], p["step"], checksum=query_checksum(r))
            ),
            ("POST", INTERNAL_SAVES_ROUTE): lambda r, p: self._answer(
                tier.local_drop_other_saves(p["namespace"], p["step"], required_save(r))
            ),
            ("PUT", INTERNAL_REPLICA_ROUTE): self._put_replica,
            ("POST", INTERNAL_PERSIST_ROUTE): self._persist,
            ("DELETE", INTERNAL_SHARD_ROUTE): lambda r, p: self._answer(
                tier.local_delete(p["namespace"], p["rank"], p["step"])
            ),
            ("DELETE", INTERNAL_NAMESPACE_ROUTE): lambda r, p: self._now(
                lambda: tier.local_delete_namespace(p["namespace"])
            ),
            ("POST", INTERNAL_RESET_ROUTE): lambda r, p: self._now(tier.local_reset),
            ("PUT", INTERNAL_CATALOG_ROUTE): self._catalog_report,
            ("GET", INTERNAL_CATALOG_ROUTE): lambda r, p: self._answer(
                tier.catalog_images(p["namespace"])
                if query_flag(r, IMAGES_PARAMETER)
                else tier.catalog_steps(p["namespace"], query_int(r, "num_ranks"))
            ),
            ("GET", INTERNAL_HOLDERS_ROUTE): lambda r, p: self._answer(
                tier.catalog_holders(p["namespace"], p["step"], parse_qs(r.query).get("rank", [None])[0])
            ),
        }
        return [(agent_route(method, template), handler) for (method, template), handler in table.items()]

    # ------------------------------------------------------------------ requests read here

    @staticmethod
    async def _answer(answer: Awaitable[Answer], *, status: int = 200) -> Response:
        return respond(await answer, status=status)

    @staticmethod
    async def _now(answer: Callable[[], Answer]) -> Response:
        return respond(answer())

    async def _create_namespace(self, request: Request, parameters: Parameters) -> Response:
        name = parameters["namespace"]
        checked_new_namespace(name)
        num_ranks = query_int(request, "num_ranks")
        steps = query_int(request, "steps_retained", default=3)
        doc = await self.tier.create_namespace(name, num_ranks=num_ranks, steps_retained=steps)
        return respond(doc, status=201)

    async def _latest(self, request: Request, parameters: Parameters) -> Response:
        name = parameters["namespace"]
        checked_namespace(name)
        limit = query_int(request, "limit", default=5)
        if query_flag(request, WORLD_SIZES_PARAMETER):
            return respond(await self.tier.latest_sizes(name, limit=limit))
        return respond(await self.tier.latest(name, limit=limit))

    async def _put_replica(self, request: Request, parameters: Parameters) -> Response:
        owner = parse_qs(request.query).get(OWNER_PARAMETER, [None])[0]
        name, rank, step = parameters["namespace"], parameters["rank"], parameters["step"]
        return respond(await self.tier.put_replica(name, rank, step, BodyUpload(request), owner=owner))

    async def _catalog_report(self, request: Request, parameters: Parameters) -> Response:
        # A node holding every rank of a large namespace: 65,537 ranks of a few steps is a few MiB.
        body = await request.read_body(limit=64 * 1024 * 1024)
        return respond(self.tier.catalog_report(parameters["namespace"], body))

    async def _persist(self, request: Request, parameters: Parameters) -> Response:
        name = parameters["namespace"]
        checked_namespace(name)
        try:
            number = canonical_int(parameters["step"], what="step")
            body = PersistRequest.parse(await request.read_body())
        except (ValueError, RecursionError) as exc:  # a ValidationError is a ValueError
            why = problem_of(exc) if isinstance(exc, ValueError) else str(exc)[:200]
            raise TierError(
                400, "InvalidPersist", f"a persist request needs a JSON body and a step: {why}"
            ) from exc
        return respond(await self.tier.persist(name, number, body))
