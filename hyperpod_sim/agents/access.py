"""Who may call an agent route: one check for every route that needs a token.

- ``PUT /v1/policy`` (the control plane): this node's control-plane token, always.
- ``/v1/internal/*`` (the other agents of the cluster): the cluster token, always.
- ``/v1/cp`` writes and deletes (everything but GET) and every fast-path route, under
  ``/v1/fast/...`` or its alias ``/v1/cp/fast/...``: the cluster's checkpoint token, when its
  checkpoint policy's ``AgentAccess`` is ``Token``; nothing when ``Open``.

Refusals: 401 ``MissingToken`` without a usable ``Authorization: Bearer`` header, 401
``NotRegistered`` while the agent does not know what to check against yet, 403 ``InvalidToken``
for a wrong token (docs/agent-protocol.md, docs/memory-tier.md).
"""

from __future__ import annotations

from hyperpod_sim.agents.http.server import Request, Response, error_response
from hyperpod_sim.agents.state import AgentState, AuthStatus, Credential
from hyperpod_sim.contracts.agent_api import POLICY_PATH, AgentApi, AgentRoute

_BEARER = (("WWW-Authenticate", 'Bearer realm="hyperpod-sim-agent"'),)


def refusal(state: AgentState, request: Request, credential: Credential) -> Response | None:
    """The error answer for a request without ``credential``; None when it may go on."""
    auth = state.check_token(request.headers.get("authorization"), credential)
    if auth is AuthStatus.OK:
        return None
    if auth is AuthStatus.MISSING:
        message = f"missing or malformed Authorization header; expected 'Bearer <{credential.value}>'"
        return error_response(401, "MissingToken", message, headers=_BEARER)
    if auth is AuthStatus.NOT_REGISTERED:
        message = (
            "the agent's policy names no checkpoint token to check against"
            if credential is Credential.CHECKPOINT
            else f"the agent is not registered yet: it does not know the {credential.value} to check"
        )
        return error_response(401, "NotRegistered", message, headers=_BEARER)
    if credential is Credential.CONTROL_PLANE:
        message = (
            f"the token is not the control-plane token of node {state.node_id}: policies are pushed "
            "by the control plane only"
        )
        return error_response(403, "InvalidToken", message)
    return error_response(403, "InvalidToken", f"the token is not the {credential.value} of {state.cluster}")


def checkpoint_credential(state: AgentState, method: str, *, fast_path: bool) -> Credential | None:
    """The credential a tier route needs. ``fast_path``: the route is one of the same-host fast
    path's, whichever prefix reached it (``/v1/fast/...``, or ``/v1/cp/fast/...``: a locate there
    without the token answered a path, a checksum and a lease, issue 23)."""
    if not state.checkpoint_token_required:
        return None
    if fast_path or method not in ("GET", "HEAD"):
        return Credential.CHECKPOINT
    return None


def route_credential(state: AgentState, route: AgentRoute) -> Credential | None:
    """The credential a route of ``contracts.agent_api.AGENT_ROUTES`` needs (None: anyone), by
    the API it belongs to (the rules above)."""
    if route.api is AgentApi.INTERNAL:
        return Credential.CLUSTER
    if route.api is AgentApi.ADMIN:
        return Credential.CONTROL_PLANE if (route.method, route.template) == ("PUT", POLICY_PATH) else None
    return checkpoint_credential(state, route.method, fast_path=route.api is AgentApi.FAST)
