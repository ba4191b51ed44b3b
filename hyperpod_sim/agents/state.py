"""What a node agent knows: who it is, its tokens, the policy it applied, its counters.

Everything here runs on the agent's one event loop, without awaiting: each method is atomic with
respect to the HTTP handlers and the control plane loop.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import SecretStr

from hyperpod_sim.contracts.policy import NodePolicy, PolicyError, parse_policy

# Called after a policy is applied, with the previous policy (None before the first) and the new one.
PolicyListener = Callable[[NodePolicy | None, NodePolicy], None]


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
    policy: NodePolicy | None = None
    heartbeat_interval_s: float = 0.0  # the one in force (the agent loop's)
    counters: Counters = field(default_factory=Counters)
    listeners: list[PolicyListener] = field(default_factory=list)

    @property
    def applied_generation(self) -> int:
        return self.policy.generation if self.policy else 0

    @property
    def memory_budget_bytes(self) -> int:
        return self.policy.memory_budget_bytes if self.policy else 0

    @property
    def tiered_storage_enabled(self) -> bool:
        return self.policy.tiered_storage.enabled if self.policy else False

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
        return self.policy.checkpoint_access.token_required if self.policy else False

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
        digest = self.policy.checkpoint_access.token_sha256 if self.policy else None
        if digest is None:
            return AuthStatus.NOT_REGISTERED
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
        return AuthStatus.OK if hmac.compare_digest(presented, digest) else AuthStatus.WRONG

    def apply_policy(self, doc: object, *, reset: bool = False) -> ApplyOutcome:
        """Apply a policy document: newer generations replace the one in force, the same generation
        is a no-op, older ones are refused, unless ``reset`` (the control plane re-syncs an agent
        that holds a generation it never issued). The document is validated here, once; listeners
        (the checkpoint tiers) see every change, as ``NodePolicy`` models."""
        try:
            policy = self._validate(doc)
        except PolicyError as exc:
            return ApplyOutcome(ApplyStatus.INVALID, self.applied_generation, str(exc))
        generation = policy.generation
        current = self.applied_generation
        if generation < current and not reset:
            return ApplyOutcome(
                ApplyStatus.STALE,
                current,
                f"generation {generation} is older than the applied generation {current}",
            )
        if generation == current:
            return ApplyOutcome(ApplyStatus.UNCHANGED, current, f"generation {current} is already applied")
        previous, self.policy = self.policy, policy
        self.counters.policy_applies_total += 1
        for listener in self.listeners:
            listener(previous, policy)
        return ApplyOutcome(ApplyStatus.APPLIED, generation, f"applied generation {generation}")

    def _validate(self, doc: object) -> NodePolicy:
        """The policy ``doc`` is, if it is one and is for this agent; PolicyError otherwise."""
        policy = parse_policy(doc)
        for key, theirs, mine in (
            ("node_id", policy.node_id, self.node_id),
            ("cluster_name", policy.cluster_name, self.cluster),
        ):
            if theirs is not None and mine is not None and theirs != mine:
                raise PolicyError(f"the policy is for {key} {theirs!r}, this agent's {key} is {mine!r}")
        return policy


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
