"""What a node agent knows: who it is, its tokens, the policy it applied, its counters.

Everything here runs on the agent's one event loop, without awaiting: each method is atomic with
respect to the HTTP handlers and the control plane loop.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

PolicyDocument = dict[str, Any]
# Called after a policy is applied, with the previous document (None before the first) and the new one.
PolicyListener = Callable[[PolicyDocument | None, PolicyDocument], None]


class ApplyStatus(enum.Enum):
    APPLIED = "applied"  # a newer generation (or any, with a reset): now in force
    UNCHANGED = "unchanged"  # the generation in force again: nothing done
    STALE = "stale"  # older than the generation in force: refused
    INVALID = "invalid"  # not a policy document: refused


@dataclass(frozen=True)
class ApplyOutcome:
    status: ApplyStatus
    applied_generation: int
    message: str = ""

    @property
    def accepted(self) -> bool:
        return self.status in (ApplyStatus.APPLIED, ApplyStatus.UNCHANGED)


class Credential(enum.Enum):
    """What a caller of an agent route must present in ``Authorization: Bearer <token>``."""

    # The other agents of the cluster (/v1/internal/*).
    CLUSTER = "cluster token"
    # The control plane this agent registered with, and only it: policy pushes (PUT /v1/policy).
    # Not the cluster token, which every agent of the cluster holds.
    CONTROL_PLANE = "control-plane token"
    # Trainers writing checkpoints while the cluster's AgentAccess is Token (/v1/cp writes, /v1/fast).
    CHECKPOINT = "checkpoint token"


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class AuthStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no or malformed Authorization header: 401
    NOT_REGISTERED = "not_registered"  # no token known yet (registration answers them): 401
    WRONG = "wrong"  # a token, not the expected one: 403


@dataclass
class Counters:
    heartbeats_total: int = 0
    heartbeat_failures_total: int = 0
    policy_applies_total: int = 0
    # Authorised PUT /v1/policy calls, applied or not: shows duplicate pushes.
    policy_pushes_total: int = 0


@dataclass(kw_only=True)
class AgentState:
    """``cluster_token``: what agents of the cluster present to each other (``/v1/internal``).
    ``node_token``: this node's credential at the control plane. ``control_plane_token``: what
    the control plane presents to this agent alone (``PUT /v1/policy``). Registration answers all
    three (docs/agent-protocol.md)."""

    cluster: str
    node_id: str | None = None
    cluster_token: SecretStr | None = None
    node_token: SecretStr | None = None
    control_plane_token: SecretStr | None = None
    registered: bool = False
    policy: PolicyDocument | None = None
    counters: Counters = field(default_factory=Counters)
    listeners: list[PolicyListener] = field(default_factory=list)

    @property
    def applied_generation(self) -> int:
        return int(self.policy["generation"]) if self.policy else 0

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.policy.get("memory_budget_bytes") or 0) if self.policy else 0

    @property
    def tiered_storage_enabled(self) -> bool:
        if not self.policy:
            return False
        tiered = self.policy.get("tiered_storage") or {}
        return bool(tiered.get("enabled", False))

    def mark_registered(
        self, *, node_id: str, cluster_token: SecretStr, node_token: SecretStr, control_plane_token: SecretStr
    ) -> None:
        self.node_id = node_id
        self.cluster_token = cluster_token
        self.node_token = node_token
        self.control_plane_token = control_plane_token
        self.registered = True

    @property
    def checkpoint_token_required(self) -> bool:
        """Whether the cluster's AgentAccess is Token: checkpoint writes need the checkpoint token.
        A policy without ``checkpoint_access`` (an older control plane) is Open."""
        access = (self.policy or {}).get("checkpoint_access") or {}
        return access.get("mode") == "Token"

    def check_token(
        self, authorization: str | None, credential: Credential = Credential.CLUSTER
    ) -> AuthStatus:
        """Check an ``Authorization: Bearer <token>`` header against ``credential``, in constant time.

        The cluster token is compared as it is; the checkpoint token by its SHA-256, which is all
        the policy carries of it."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return AuthStatus.MISSING
        if credential is Credential.CLUSTER:
            return _check_bearer(authorization, self.cluster_token)
        if credential is Credential.CONTROL_PLANE:
            return _check_bearer(authorization, self.control_plane_token)
        digest = ((self.policy or {}).get("checkpoint_access") or {}).get("token_sha256")
        if not isinstance(digest, str):
            return AuthStatus.NOT_REGISTERED
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
        return AuthStatus.OK if hmac.compare_digest(presented, digest) else AuthStatus.WRONG

    def apply_policy(self, doc: object, *, reset: bool = False) -> ApplyOutcome:
        """Apply a policy document: newer generations replace the one in force, the same generation
        is a no-op, older ones are refused, unless ``reset`` (the control plane re-syncs an agent
        that holds a generation it never issued). Listeners (the checkpoint tiers) see every change."""
        problem = self._validate(doc)
        if problem is not None:
            return ApplyOutcome(ApplyStatus.INVALID, self.applied_generation, problem)
        assert isinstance(doc, dict)
        generation: int = doc["generation"]
        current = self.applied_generation
        if generation < current and not reset:
            return ApplyOutcome(
                ApplyStatus.STALE,
                current,
                f"generation {generation} is older than the applied generation {current}",
            )
        if generation == current:
            return ApplyOutcome(ApplyStatus.UNCHANGED, current, f"generation {current} is already applied")
        previous, self.policy = self.policy, dict(doc)
        self.counters.policy_applies_total += 1
        for listener in self.listeners:
            listener(previous, self.policy)
        return ApplyOutcome(ApplyStatus.APPLIED, generation, f"applied generation {generation}")

    def _validate(self, doc: object) -> str | None:
        if not isinstance(doc, dict):
            return f"a policy document must be a JSON object, got {_json_type(doc)}"
        generation = doc.get("generation")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
            return f"'generation' must be an integer >= 1, got {generation!r}"
        budget = doc.get("memory_budget_bytes")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            return f"'memory_budget_bytes' must be an integer >= 0, got {budget!r}"
        tiered = doc.get("tiered_storage")
        if tiered is not None and (
            not isinstance(tiered, dict) or not isinstance(tiered.get("enabled", False), bool)
        ):
            return f"'tiered_storage' must be an object with a boolean 'enabled', got {tiered!r}"
        access = doc.get("checkpoint_access")
        if access is not None:
            mode = access.get("mode") if isinstance(access, dict) else None
            digest = access.get("token_sha256") if isinstance(access, dict) else None
            if mode not in ("Open", "Token") or (
                mode == "Token" and not (isinstance(digest, str) and _SHA256_HEX.fullmatch(digest))
            ):
                return (
                    '\'checkpoint_access\' must be {"mode": "Open"} or {"mode": "Token", '
                    f'"token_sha256": <64 hex digits>}}, got {str(access)[:200]}'
                )
        for key, mine in (("node_id", self.node_id), ("cluster_name", self.cluster)):
            theirs = doc.get(key)
            if theirs is not None and mine is not None and theirs != mine:
                return f"the policy is for {key} {theirs!r}, this agent's {key} is {mine!r}"
        return None


def _check_bearer(authorization: str | None, expected: SecretStr | None) -> AuthStatus:
    """Check an ``Authorization: Bearer <token>`` header against ``expected``, in constant time."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return AuthStatus.MISSING
    if expected is None:
        return AuthStatus.NOT_REGISTERED
    matches = hmac.compare_digest(token.encode(), expected.get_secret_value().encode())
    return AuthStatus.OK if matches else AuthStatus.WRONG


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
