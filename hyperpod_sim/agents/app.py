"""The agent's admin API (``docs/agent-protocol.md``, "Agent API")."""

from __future__ import annotations

import json
from urllib.parse import parse_qs

from hyperpod_sim.agents.access import refusal
from hyperpod_sim.agents.httpserver import DropConnection, Request, Response, error_response, json_response
from hyperpod_sim.agents.metrics import CONTENT_TYPE, agent_metrics, render, s3_metrics, tier_metrics
from hyperpod_sim.agents.state import AgentState, ApplyStatus, Credential
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.agents.tierroutes import RouteMatch, TierRoutes
from hyperpod_sim.contracts.agent_api import POLICY_PATH
from hyperpod_sim.contracts.partition import Partition


class AgentApp:
    """Every route of the agent: the admin API's here, the memory tier's from
    :class:`agents.tierroutes.TierRoutes`. Who may call a route is checked here, once, for all of
    them (:func:`agents.access.refusal`): one shape of refusal whatever the route."""

    def __init__(
        self, *, state: AgentState, tier: MemoryTier | None = None, partition: Partition | None = None
    ) -> None:
        self._state = state
        self._tier = tier
        self._tier_routes = TierRoutes(tier) if tier is not None else None
        self._partition = partition
        self._routes: dict[str, dict[str, RouteMatch]] = {
            "/health": {"GET": RouteMatch(self.health, None)},
            POLICY_PATH: {
                "GET": RouteMatch(self.get_policy, None),
                # A policy push: only from the control plane, with this node's control-plane token.
                "PUT": RouteMatch(self.put_policy, Credential.CONTROL_PLANE),
            },
            "/metrics": {"GET": RouteMatch(self.metrics, None)},
        }

    async def __call__(self, request: Request) -> Response:
        if self._partition is not None and self._partition.blocks(request.headers.get("user-agent", "")):
            # The control plane is cut off (a NetworkPartition): the connection closes unanswered.
            raise DropConnection(f"network partition (fault {self._partition.fault_id})")
        found = self._match(request)
        if isinstance(found, Response):
            return found
        if found.credential is not None:
            refused = refusal(self._state, request, found.credential)
            if refused is not None:
                return refused
        return await found.handler(request)

    def _match(self, request: Request) -> RouteMatch | Response:
        """The route of a request, or the answer when there is none (404, 405)."""
        if self._tier_routes is not None and request.path.startswith("/v1/"):
            matched = self._tier_routes.match(request)
            if matched is not None:
                return matched
        methods = self._routes.get(request.path.rstrip("/") or "/")
        if methods is None:
            return error_response(404, "NotFound", f"no route {request.path}")
        route = methods.get(request.method)
        if route is None:
            allowed = ", ".join(methods)
            return error_response(
                405,
                "MethodNotAllowed",
                f"{request.method} is not allowed on {request.path}; allowed: {allowed}",
                headers=(("Allow", allowed),),
            )
        return route

    async def health(self, request: Request) -> Response:
        state = self._state
        return json_response(
            200,
            {
                "status": "ok",
                "node_id": state.node_id,
                "cluster": state.cluster,
                "registered": state.registered,
                "applied_generation": state.applied_generation,
            },
        )

    async def get_policy(self, request: Request) -> Response:
        policy = self._state.policy
        return json_response(200, policy.document() if policy else {"generation": 0})

    async def put_policy(self, request: Request) -> Response:
        """A policy push (the caller's control-plane token is checked already). ``?reset=true``:
        apply it even if it is older than the one in force (the control plane re-syncs an agent
        that holds a generation it never issued)."""
        state = self._state
        query = parse_qs(request.query)
        reset_values = query.get("reset", ["false"])
        if len(reset_values) != 1 or reset_values[0] not in ("true", "false"):
            return error_response(400, "InvalidRequest", "reset must be true or false")
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
        return json_response(200, {"applied_generation": outcome.applied_generation})

    async def metrics(self, request: Request) -> Response:
        metrics = agent_metrics(self._state)
        if self._tier is not None:
            metrics += tier_metrics(self._tier) + s3_metrics(self._tier)
        body = render(metrics).encode()
        return Response(status=200, body=body, content_type=CONTENT_TYPE)
