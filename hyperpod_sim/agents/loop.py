"""The agent's side of the protocol: register, apply the policy answered, heartbeat, pull when behind.

Temporary failures (the control plane unreachable, timeouts, 5xx) are retried with capped exponential
backoff; permanent ones (401/403, unknown cluster, no free slot, answers off the contract) are logged
as errors and retried slowly, the admin API staying up. A 404 on heartbeat means the node was deleted:
:meth:`AgentLoop.run` then returns :attr:`LoopOutcome.NODE_DELETED`. Each step returns an outcome;
no exception escapes the loop but cancellation.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import SecretStr

from hyperpod_sim.agents.control_plane import ControlPlaneClient, Failure, Reply
from hyperpod_sim.agents.retry import Backoff as Backoff
from hyperpod_sim.agents.state import AgentState, ApplyStatus
from hyperpod_sim.contracts.agent_bodies import S3TierStatus

log = logging.getLogger("hyperpod_sim.agents.loop")

Sleep = Callable[[float], Awaitable[None]]
# The longest heartbeat interval adopted from an answer (a larger one is off the contract).
MAX_ADOPTED_INTERVAL_S = 3600.0
# What each heartbeat reports as the node's S3 tier (its `s3` member); None: no S3 tier.
StatusProvider = Callable[[], S3TierStatus | None]


class LoopOutcome(enum.Enum):
    NODE_DELETED = "node_deleted"


@dataclass(frozen=True, kw_only=True)
class Identity:
    """What the agent reports about itself."""

    endpoint: str
    pid: int
    instance_type: str | None
    memory_bytes: int


class AgentLoop:
    def __init__(
        self,
        *,
        state: AgentState,
        client: ControlPlaneClient,
        identity: Identity,
        token: SecretStr,
        heartbeat_interval_s: float,
        adopt_control_plane_interval: bool,
        backoff: Backoff,
        permanent_retry_s: float,
        sleep: Sleep = asyncio.sleep,
        status_provider: StatusProvider | None = None,
    ) -> None:
        self._state = state
        self._client = client
        self._identity = identity
        self._token = token  # the node's launch secret with a node id, the bootstrap token without
        self._interval_s = state.heartbeat_interval_s = heartbeat_interval_s
        self._adopt_interval = adopt_control_plane_interval
        self._backoff = backoff
        self._jitter = random.Random()
        self._permanent_retry_s = permanent_retry_s
        self._sleep = sleep
        self._status_provider = status_provider
        self._failing_since_ok = 0
        # Started for a node with its launch secret (not an external agent with the bootstrap
        # token), and no heartbeat taken since the last registration: the secret is not spent yet.
        self._launched = state.node_id is not None
        self._secret_unspent = False
        self._registration_refused = False  # the last registration was refused for good

    @property
    def heartbeat_interval_s(self) -> float:
        return self._interval_s

    async def run(self) -> LoopOutcome:
        while not await self._guarded(self.register_once, "registration"):
            pass
        while True:
            outcome = await self._guarded(self.heartbeat_once, "heartbeat")
            if isinstance(outcome, LoopOutcome):
                return outcome

    async def _guarded(
        self, step: Callable[[], Awaitable[bool | LoopOutcome | None]], what: str
    ) -> bool | LoopOutcome | None:
        """Run one step; a bug in it is logged and retried slowly instead of ending the loop."""
        try:
            return await step()
        except Exception as exc:
            log.exception("%s step failed unexpectedly", what)
            await self._failed(what, Reply(failure=Failure.PERMANENT, message=f"{type(exc).__name__}: {exc}"))
            return None

    async def register_once(self) -> bool:
        """One registration attempt; on failure, waits before returning False."""
        state = self._state
        reply = await self._client.register(
            token=self._token.get_secret_value(),
            node_id=state.node_id,
            endpoint=self._identity.endpoint,
            pid=self._identity.pid,
            instance_type=self._identity.instance_type,
            memory_bytes=self._identity.memory_bytes,
        )
        if reply.ok:
            problem = self._accept_registration(reply)
            if problem is None:
                self._recovered("registration")
                return True
            reply = Reply(failure=Failure.PERMANENT, status=reply.status, message=problem)
        self._registration_refused = reply.failure is not Failure.TEMPORARY
        await self._failed("registration", reply)
        return False

    async def heartbeat_once(self) -> LoopOutcome | None:
        """One heartbeat (and a pull when behind), then the wait before the next one."""
        state = self._state
        assert state.node_id is not None
        assert state.node_token is not None
        reply = await self._client.heartbeat(
            token=state.node_token.get_secret_value(),
            node_id=state.node_id,
            applied_generation=state.applied_generation,
            endpoint=self._identity.endpoint,
            pid=self._identity.pid,
            s3_status=self._s3_status(),
        )
        if reply.failure is Failure.NOT_FOUND:
            log.warning(
                "node %s: the control plane no longer knows this node (%s)", state.node_id, reply.message
            )
            return LoopOutcome.NODE_DELETED
        if reply.failure is Failure.UNAUTHORIZED and self._launched and self._secret_unspent:
            # The token this agent was answered is not the node's: a registration it had given up
            # on (a timeout under load) was carried out after the one it took, and issued other
            # tokens. No heartbeat has spent the launch secret yet: register again with it.
            log.warning(
                "node %s: the node token is refused (%s); registering again", state.node_id, reply.message
            )
            if not await self.register_once() and self._registration_refused:
                self._secret_unspent = False  # spent after all: heartbeat on (a 404 still ends it)
            return None  # a busy control plane (503, a timeout): tried again at the next refusal
        if not reply.ok:
            await self._failed("heartbeat", reply)
            return None
        self._secret_unspent = False
        state.counters.heartbeats_total += 1
        assert reply.body is not None
        desired = reply.body.get("desired_generation")
        if isinstance(desired, bool) or not isinstance(desired, int):
            bad = Reply(failure=Failure.PERMANENT, status=200, message=f"desired_generation is {desired!r}")
            await self._failed("heartbeat", bad)
            return None
        self._recovered("heartbeat")
        self._adopt(reply.body.get("heartbeat_interval_s"))
        # Behind: pull, unless the control plane says its push is under way (a rollout of a large
        # cluster would otherwise cost it one pull per agent that heartbeats before its push).
        behind = desired > state.applied_generation and reply.body.get("push_pending") is not True
        if behind and not await self.pull():
            return None  # pull() waited already
        await self._sleep(self._interval_s)
        return None

    def _adopt(self, interval: object) -> None:
        """The interval the control plane answered (at registration, and at every heartbeat: it
        grows with the number of agents), unless this agent's was set explicitly."""
        if (
            self._adopt_interval
            and isinstance(interval, int | float)
            and not isinstance(interval, bool)
            and 0 < interval <= MAX_ADOPTED_INTERVAL_S
        ):
            self._interval_s = self._state.heartbeat_interval_s = float(interval)

    def _s3_status(self) -> S3TierStatus | None:
        """The status provider's answer; a failing provider costs the report, not the heartbeat."""
        if self._status_provider is None:
            return None
        try:
            return self._status_provider()
        except Exception:
            log.exception("the S3 status could not be read; heartbeating without it")
            return None

    async def pull(self) -> bool:
        """Fetch the node's current policy and apply it; on failure, waits before returning False."""
        state = self._state
        assert state.node_id is not None
        assert state.node_token is not None
        reply = await self._client.fetch_policy(
            token=state.node_token.get_secret_value(), node_id=state.node_id
        )
        if reply.ok:
            outcome = state.apply_policy(reply.body)
            if outcome.status is not ApplyStatus.INVALID:
                log.info("node %s: pulled policy, %s", state.node_id, outcome.message)
                return True
            reply = Reply(failure=Failure.PERMANENT, status=200, message=f"invalid policy: {outcome.message}")
        await self._failed("policy pull", reply)
        return False

    def _accept_registration(self, reply: Reply) -> str | None:
        """Take the registration answer in; a description of what is wrong with it, or None."""
        state = self._state
        body = reply.body or {}
        node_id = body.get("node_id") or state.node_id
        if not isinstance(node_id, str) or not node_id:
            return f"the registration answer has no node_id (got {body.get('node_id')!r})"
        if state.node_id is not None and node_id != state.node_id:
            log.warning("registered as node %s, not %s: using the control plane's id", node_id, state.node_id)
        tokens = {}
        for member in ("cluster_token", "node_token", "control_plane_token"):
            value = body.get(member)
            if not isinstance(value, str) or not value:
                return f"the registration answer has no {member}"
            tokens[member] = SecretStr(value)
        self._adopt(body.get("heartbeat_interval_s"))
        state.mark_registered(node_id=node_id, **tokens)
        self._secret_unspent = True
        log.info("registered as node %s of cluster %s", node_id, state.cluster)
        policy = body.get("policy")
        if policy is not None:
            outcome = state.apply_policy(policy)
            if outcome.status is ApplyStatus.INVALID:
                log.error("node %s: the registration's policy is invalid: %s", node_id, outcome.message)
        return None

    async def _failed(self, what: str, reply: Reply) -> None:
        self._state.counters.heartbeat_failures_total += 1
        self._failing_since_ok += 1
        if reply.failure is Failure.TEMPORARY:
            delay = self._backoff.next_delay()
            if what == "heartbeat":
                delay = max(delay, self._interval_s)
            if reply.retry_after_s is not None:  # busy: at least what it asked, spread up to twice
                delay = max(delay, reply.retry_after_s * (1.0 + self._jitter.random()))
            level = logging.WARNING if self._failing_since_ok == 1 else logging.DEBUG
            log.log(level, "%s failed (%s), retrying in %.2fs", what, _describe(reply), delay)
        else:
            delay = self._permanent_retry_s
            log.error("%s refused (%s), retrying in %.1fs", what, _describe(reply), delay)
        await self._sleep(delay)

    def _recovered(self, what: str) -> None:
        if self._failing_since_ok:
            log.warning("%s succeeded after %d failed calls", what, self._failing_since_ok)
        self._failing_since_ok = 0
        self._backoff.reset()


def _describe(reply: Reply) -> str:
    status = f"HTTP {reply.status}: " if reply.status is not None else ""
    return f"{status}{reply.message}".strip() or (reply.failure.value if reply.failure else "")
