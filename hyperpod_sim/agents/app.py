"""The agent's admin API (``docs/agent-protocol.md``, "Agent API")."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from urllib.parse import parse_qs

from hyperpod_sim.agents.access import refusal, route_credential
from hyperpod_sim.agents.http.server import DropConnection, Request, Response, error_response, json_response
from hyperpod_sim.agents.launcher.hotpages import SELF_PUSH_AGENT
from hyperpod_sim.agents.metrics import CONTENT_TYPE, agent_metrics, render, s3_metrics, tier_metrics
from hyperpod_sim.agents.state import AgentState, ApplyStatus, AuthStatus, Credential
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.agents.tiermodel import TierError
from hyperpod_sim.agents.tierroutes import Handler, Parameters, TierRoutes, tiering_off
from hyperpod_sim.agents.tierroutes import refused as tier_refused
from hyperpod_sim.contracts.agent_api import (
    AGENT_PUSH_IDLE_S,
    HEALTH_PATH,
    METRICS_PATH,
    POLICY_PATH,
    AgentApi,
    AgentRoute,
    RouteTable,
    agent_route,
)
from hyperpod_sim.contracts.agent_bodies import AgentHealth, PolicyApplied
from hyperpod_sim.contracts.partition import Partition


@dataclass(frozen=True)
class Endpoint:
    """A route of the agent and what answers it."""

    route: AgentRoute
    handler: Handler


class AgentApp:
    """Every route of the agent, in one table built from ``contracts.agent_api.AGENT_ROUTES``: the
    admin API's handlers here, the memory tier's from :class:`agents.tierroutes.TierRoutes` (an
    agent without a tier serves the admin API only). Who may call a route is checked here, once,
    for all of them (:func:`agents.access.refusal`): one shape of refusal whatever the route."""

    def __init__(
        self, *, state: AgentState, tier: MemoryTier | None = None, partition: Partition | None = None
    ) -> None:
        self._state = state
        self._tier = tier
        self._partition = partition
        admin: list[tuple[AgentRoute, Handler]] = [
            (agent_route("GET", HEALTH_PATH), self.health),
            (agent_route("GET", POLICY_PATH), self.get_policy),
            (agent_route("PUT", POLICY_PATH), self.put_policy),
            (agent_route("GET", METRICS_PATH), self.metrics),
        ]
        served = admin + (TierRoutes(tier).handlers() if tier is not None else [])
        self.routes: RouteTable[Endpoint] = RouteTable((route, Endpoint(route, h)) for route, h in served)

    async def __call__(self, request: Request) -> Response:
        if self._partition is not None and self._partition.blocks(request.headers.get("user-agent", "")):
            # The control plane is cut off (a NetworkPartition): the connection closes unanswered.
            raise DropConnection(f"network partition (fault {self._partition.fault_id})")
        found = self.routes.lookup(request.path)
        if found is None:
            return error_response(404, "NotFound", f"no route {request.path}")
        endpoint = found.methods.get(request.method)
        if endpoint is None:
            return self._no_method(request, found.methods)
        route = endpoint.route
        if route.api in (AgentApi.LIBRARY, AgentApi.FAST) and not self._state.tiered_storage_enabled:
            return await tiering_off(request)
        credential = route_credential(self._state, route)
        if credential is not None:
            refused = refusal(self._state, request, credential)
            if refused is not None:
                return refused
        try:
            response = await endpoint.handler(request, found.parameters)
        except TierError as exc:
            return tier_refused(exc)
        if credential is Credential.CONTROL_PLANE or self._greeting(request, route):
            # The control plane keeps this connection for its next push (contracts/agent_api.py).
            response = replace(response, keep_idle_s=AGENT_PUSH_IDLE_S)
        return response

    def _greeting(self, request: Request, route: AgentRoute) -> bool:
        """Whether ``request`` is the control plane's greeting: ``GET /health`` with this node's
        control-plane token, on the connection it then holds for its pushes. Health stays open to
        everyone; any other token is only not kept longer."""
        if (route.method, route.template) != ("GET", HEALTH_PATH):
            return False
        authorization = request.headers.get("authorization")
        return self._state.check_token(authorization, Credential.CONTROL_PLANE) is AuthStatus.OK

    @staticmethod
    def _no_method(request: Request, methods: Mapping[str, Endpoint]) -> Response:
        """Another method on a path that routes serve: 405 on the admin API's paths; the tier's
        answer 404, as they always have (a client of the tier sees one answer for "not served")."""
        if any(endpoint.route.api is not AgentApi.ADMIN for endpoint in methods.values()):
            return error_response(404, "NotFound", f"no route {request.path}")
        allowed = ", ".join(methods)
        return error_response(
            405,
            "MethodNotAllowed",
            f"{request.method} is not allowed on {request.path}; allowed: {allowed}",
            headers=(("Allow", allowed),),
        )

    async def health(self, request: Request, parameters: Parameters) -> Response:
        state = self._state
        health = AgentHealth(
            status="ok",
            node_id=state.node_id,
            cluster=state.cluster,
            registered=state.registered,
            applied_generation=state.applied_generation,
        )
        return json_response(200, health.document())

    async def get_policy(self, request: Request, parameters: Parameters) -> Response:
        policy = self._state.policy
        return json_response(200, policy.document() if policy else {"generation": 0})

    async def put_policy(self, request: Request, parameters: Parameters) -> Response:
        """A policy push (the caller's control-plane token is checked already). ``?reset=true``:
        apply it even if it is older than the one in force (the control plane re-syncs an agent
        that holds a generation it never issued)."""
        state = self._state
        query = parse_qs(request.query)
        reset_values = query.get("reset", ["false"])
        if len(reset_values) != 1 or reset_values[0] not in ("true", "false"):
            return error_response(400, "InvalidRequest", "reset must be true or false")
        if request.headers.get("user-agent") != SELF_PUSH_AGENT:  # its own (launcher/hotpages.py)
            state.counters.policy_pushes_total += 1
        body = await request.read_body()
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return error_response(400, "InvalidPolicy", f"the body is not JSON: {str(exc)[:200]}")
        outcome = state.apply_policy(doc, reset=reset_values[0] == "true")
        if outcome.status is ApplyStatus.INVALID:
            return error_response(400, "InvalidPolicy", outcome.message)
        if outcome.status is ApplyStatus.STALE:
            return error_response(
                409, "StaleGeneration", outcome.message, applied_generation=outcome.applied_generation
            )
        return json_response(200, PolicyApplied(applied_generation=outcome.applied_generation).document())

    async def metrics(self, request: Request, parameters: Parameters) -> Response:
        metrics = agent_metrics(self._state)
        if self._tier is not None:
            metrics += tier_metrics(self._tier) + s3_metrics(self._tier)
        body = render(metrics).encode()
        return Response(status=200, body=body, content_type=CONTENT_TYPE)
