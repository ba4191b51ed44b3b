"""Policy pushes: claimed in the reconciler's transaction (``claim_pushes``), sent after it, in
parallel and outside any transaction (``PolicyPusher.send``), and their answers recorded in one
more (``PolicyPusher.record``): push retries, their backoff and last errors live in the nodes' rows,
so a restarted control plane resumes them."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from hyperpod_sim.contracts.agent_api import HEALTH_PATH, POLICY_PATH
from hyperpod_sim.domain import events
from hyperpod_sim.domain.checkpoints.agent_client import (
    AgentUnreachable,
    Answer,
    Call,
    KeptConnections,
    exchange,
)
from hyperpod_sim.domain.checkpoints.cluster_policy import S3Endpoint
from hyperpod_sim.domain.checkpoints.node_policy import PolicyBuilder
from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import LIVE, NodeStatus
from hyperpod_sim.domain.outcome import Outcome, Push
from hyperpod_sim.models import Cluster, Database, Node

log = logging.getLogger(__name__)

ACKNOWLEDGE_BATCH = 500  # node ids in one statement's IN list
# A greeting that failed (an agent hung, cut off or gone) is tried again after GREET_BACKOFF_S,
# doubled at each failure up to GREET_BACKOFF_MAX_S: a pass waits for a greeting's timeout at most
# that often for the node.
GREET_BACKOFF_S = 10.0
GREET_BACKOFF_MAX_S = 300.0


@dataclass(frozen=True)
class PushResult:
    node_id: str
    generation: int
    applied: int | None  # the generation the agent reports, or None on failure
    error: str | None = None
    permanent: bool = False
    # The generation an agent that answered "stale" (409) says it has: never an acknowledgement.
    # Ahead of every generation this control plane issued, it is a policy it did not get from
    # here, and the node is pushed again with a reset.
    ahead: int | None = None
    reset: bool = False  # the answer to a push with a reset


@dataclass(frozen=True)
class PushConfig:
    timeout_s: float
    backoff_s: float
    backoff_max_s: float
    memory_scale: float
    s3_endpoint: S3Endpoint


PUSHED = (
    NodeStatus.PENDING,
    NodeStatus.RUNNING,
    NodeStatus.SYSTEM_UPDATING,
    NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
    NodeStatus.ATTACH_IN_PROGRESS,
)


class PushedCluster(Protocol):
    """What ``needs_push`` asks of a cluster: a ``Cluster``, or a heartbeat's row of columns."""

    @property
    def generation(self) -> int: ...


class PushedNode(Protocol):
    """What ``needs_push`` and ``push_coming`` ask of a node: a ``Node``, or a heartbeat's row."""

    @property
    def status(self) -> str: ...
    @property
    def endpoint(self) -> str | None: ...
    @property
    def push_token(self) -> str | None: ...
    @property
    def acked_generation(self) -> int: ...
    @property
    def push_claimed_until(self) -> datetime | None: ...
    @property
    def next_push_at(self) -> datetime | None: ...


def needs_push(cluster: PushedCluster, node: PushedNode) -> bool:
    """Whether the node's agent is pushed the cluster's generation: it has not applied it, and it
    registered with this control plane's tokens on a node that is pushed to."""
    return (
        node.status in PUSHED
        and node.endpoint is not None
        and node.push_token is not None  # no agent registered with this control plane's tokens
        and node.acked_generation < cluster.generation
    )


def push_coming(cluster: PushedCluster, node: PushedNode, now: datetime) -> bool:
    """Whether a push of the cluster's generation is on its way to the node: claimed and its lease
    not run out, or due at the reconciler's next pass (no retry waits). An agent behind waits for
    it rather than pulling the policy (domain/nodes/agents.py, the heartbeat)."""
    if not needs_push(cluster, node):
        return False
    if node.push_claimed_until is not None and node.push_claimed_until > now:
        return True
    return node.next_push_at is None or node.next_push_at <= now


def claim_pushes(session: Session, cluster: Cluster, now: datetime, config: PushConfig) -> Outcome:
    """Claim a push of the cluster's generation for every node with an agent that has not applied
    it (and that no one else is pushing, and whose retry is due). The claims are written in one
    statement per ``ACKNOWLEDGE_BATCH`` nodes, not flushed node by node: a rollout claims them all."""
    outcome = Outcome()
    policies: PolicyBuilder | None = None  # built at the first push: most passes have none
    lease = timedelta(seconds=config.timeout_s * 2)
    claimed: list[str] = []
    for node in cluster.nodes:
        if not needs_push(cluster, node):
            continue
        if node.push_claimed_until is not None and node.push_claimed_until > now:
            outcome.note_due(node.push_claimed_until)
            continue  # another control plane (or an earlier pass) is pushing it
        if node.next_push_at is not None and node.next_push_at > now:
            outcome.note_due(node.next_push_at)
            continue
        set_committed_value(node, "push_claimed_until", now + lease)  # written below
        claimed.append(node.id)
        if policies is None:
            members = [n for n in cluster.nodes if n.status in LIVE]
            policies = PolicyBuilder(
                cluster, members, memory_scale=config.memory_scale, s3_endpoint=config.s3_endpoint
            )
        assert node.endpoint is not None  # needs_push
        assert node.push_token is not None
        outcome.pushes.append(Push(node.id, node.endpoint, node.push_token, policies.policy(node)))
    for at in range(0, len(claimed), ACKNOWLEDGE_BATCH):
        session.execute(
            update(Node)
            .where(Node.id.in_(claimed[at : at + ACKNOWLEDGE_BATCH]))
            .values(push_claimed_until=now + lease)
            .execution_options(synchronize_session=False)
        )
    return outcome


class PolicyPusher:
    """Sends claimed pushes, at most ``workers`` at once, and records what the agents answered."""

    def __init__(self, *, db: Database, clock: Clock, ids: Ids, config: PushConfig, workers: int) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.config = config
        self.workers = workers
        # One connection per agent, held for the node's life (contracts/agent_api.py, AGENT_PUSH_IDLE_S).
        self.connections = KeptConnections(timeout=config.timeout_s)
        self._held: dict[str, set[tuple[str, str]]] = {}  # cluster id -> (endpoint, token) held
        # (endpoint, token) -> (failures in a row, monotonic time of the next greeting)
        self._greet_after: dict[tuple[str, str], tuple[int, float]] = {}

    def close(self) -> None:
        self.connections.close()

    def hold(self, cluster_id: str, agents: set[tuple[str, str]]) -> None:
        """Hold a connection to each agent of ``agents`` ((endpoint, token) of the cluster's nodes
        that are pushed to), opened by a greeting (``GET /health`` with the node's control-plane
        token) before the node's first push, and close those of the nodes that left.

        A push on a connection the agent accepted long before costs it far less than one on a new
        connection (the accept and its first request: about 170 of a push's 350-390 minor faults
        once ksmd has merged the agents' pages, docs/nodes.md), and the first rollout after a
        cluster was left idle is the slowest a user meets."""
        for endpoint, token in self._held.get(cluster_id, set()) - agents:
            self.connections.drop(endpoint, token)
            self._greet_after.pop((endpoint, token), None)
        self._held[cluster_id] = agents
        now = time.monotonic()
        calls: list[tuple[tuple[str, str], Call]] = []
        for key in agents:
            if self.connections.holds(*key) or self._greet_after.get(key, (0, 0.0))[1] > now:
                continue
            try:
                calls.append((key, Call(self.connections.take(*key), "GET", HEALTH_PATH)))
            except Exception:  # an endpoint it cannot even parse (its pushes say why)
                self._greeting_failed(key, now)
        if not calls:
            return
        answers = exchange([call for _, call in calls], window=self.workers)
        now = time.monotonic()
        for (key, call), answer in zip(calls, answers, strict=True):
            if isinstance(answer, Answer) and answer.status == 200 and call.connection.open:
                self._greet_after.pop(key, None)
                self.connections.give_back(key[0], call.connection)
            else:
                call.connection.close()
                self._greeting_failed(key, now)

    def _greeting_failed(self, key: tuple[str, str], now: float) -> None:
        failures = self._greet_after.get(key, (0, 0.0))[0] + 1
        delay = min(GREET_BACKOFF_S * 2 ** (failures - 1), GREET_BACKOFF_MAX_S)
        self._greet_after[key] = (failures, now + delay)

    def retain(self, cluster_ids: Iterable[str]) -> None:
        """Close the connections held to the agents of clusters not in ``cluster_ids`` (gone)."""
        for cluster_id in set(self._held) - set(cluster_ids):
            self.hold(cluster_id, set())
            del self._held[cluster_id]

    def send(self, pushes: list[Push], *, reset: bool = False) -> list[PushResult]:
        """Push each node its policy, from this thread, over one selector (agent_client.exchange);
        with ``reset``, one the agent takes even though it is older than the one it has (the
        control plane's token is the authority). Never raises: whatever goes wrong with a push (a
        connect error, an endpoint it cannot even parse) is its node's error only."""
        path = f"{POLICY_PATH}?reset=true" if reset else POLICY_PATH
        results: list[PushResult | None] = [None] * len(pushes)
        sent: list[tuple[int, Push, Call]] = []
        for index, push in enumerate(pushes):
            try:
                connection = self.connections.take(push.endpoint, push.token)
                sent.append((index, push, Call(connection, "PUT", path, push.policy.document_json())))
            except Exception as exc:  # an endpoint it cannot even parse (a port out of range)
                error = f"{type(exc).__name__}: {exc}"
                results[index] = PushResult(push.node_id, push.policy.generation, None, error, reset=reset)
        answers = exchange([call for _, _, call in sent], window=self.workers)
        for (index, push, call), answer in zip(sent, answers, strict=True):
            results[index] = self._result(push, answer, reset=reset)
            self.connections.give_back(push.endpoint, call.connection)
        done = [result for result in results if result is not None]
        assert len(done) == len(pushes)  # each push either failed before sending or was answered
        return done

    def _result(self, push: Push, answer: Answer | AgentUnreachable, *, reset: bool) -> PushResult:
        generation = push.policy.generation
        if isinstance(answer, AgentUnreachable):
            return PushResult(push.node_id, generation, None, str(answer), reset=reset)
        status, text = answer.status, answer.text
        applied = _applied_generation(text)
        if status == 200 and applied is not None:
            return PushResult(push.node_id, generation, applied, reset=reset)
        error = f"HTTP {status}: {text[:200]}"
        if status == 409 and applied is not None and applied > generation and not reset:
            error = f"the agent answered that it has generation {applied}, newer than {generation}"
            return PushResult(push.node_id, generation, None, error, ahead=applied)
        permanent = status == 200 or 400 <= status < 500  # a 200 off the contract too
        return PushResult(push.node_id, generation, None, error, permanent, reset=reset)

    def record(self, cluster_id: str, results: list[PushResult]) -> set[str]:
        """Record what the agents answered; the nodes to push again with a reset (their agents are
        ahead of every generation this control plane issued)."""
        now = self.clock.now()
        resets: set[str] = set()
        acknowledged: dict[int, list[str]] = {}  # generation acknowledged -> nodes
        for result in results:
            if result.applied is not None:
                acknowledged.setdefault(min(result.applied, result.generation), []).append(result.node_id)
        rest = [r for r in results if r.applied is None]
        with self.db.write() as session:
            for generation, node_ids in acknowledged.items():
                _acknowledge(session, generation, node_ids)
            if not rest:
                return resets
            cluster = session.get(Cluster, cluster_id)
            nodes = {
                n.id: n for n in session.scalars(select(Node).where(Node.id.in_([r.node_id for r in rest])))
            }
            for result in rest:
                node = nodes.get(result.node_id)
                if node is None:
                    continue
                node.push_claimed_until = None
                if result.ahead is not None and cluster is not None:
                    if result.ahead > cluster.generation:
                        self._reset(session, cluster, node, result, now)
                        resets.add(node.id)
                        continue
                    # A newer generation of ours (another control plane pushed it first).
                    result = replace(result, applied=result.generation)
                self._record_one(node, result, now)
        return resets

    def _reset(
        self, session: Session, cluster: Cluster, node: Node, result: PushResult, now: datetime
    ) -> None:
        """The agent has a generation this control plane never issued: it is pushed ours again,
        with a reset, at once."""
        events.node_event(
            session,
            node,
            f"The agent of node {node.id} reported policy generation "
            f"{result.ahead}, ahead of this control plane's {cluster.generation}: a "
            "policy it did not get from the control plane. Re-syncing it to generation "
            f"{result.generation}.",
            ids=self.ids,
            now=now,
            level=Level.WARN,
        )
        node.push_claimed_until = now + timedelta(seconds=self.config.timeout_s * 2)

    def _record_one(self, node: Node, result: PushResult, now: datetime) -> None:
        if result.applied is not None:
            node.acked_generation = max(node.acked_generation, min(result.applied, result.generation))
            node.push_attempts = 0
            node.next_push_at = None
            node.last_error = None
            return
        node.push_attempts += 1
        if result.permanent:
            delay = self.config.backoff_max_s
        else:
            delay = min(self.config.backoff_s * 2 ** (node.push_attempts - 1), self.config.backoff_max_s)
        node.next_push_at = now + timedelta(seconds=delay)
        node.last_error = f"policy push of generation {result.generation} failed: {result.error}"
        log.info("push to %s failed (attempt %d): %s", node.id, node.push_attempts, result.error)


def _acknowledge(session: Session, generation: int, node_ids: list[str]) -> None:
    """The nodes' agents applied ``generation`` (what ``_record_one`` records of an acknowledged push),
    in one statement per ``ACKNOWLEDGE_BATCH`` nodes instead of loading and flushing every row: a
    rollout acknowledges every node of the cluster at once."""
    for at in range(0, len(node_ids), ACKNOWLEDGE_BATCH):
        session.execute(
            update(Node)
            .where(Node.id.in_(node_ids[at : at + ACKNOWLEDGE_BATCH]))
            .values(
                acked_generation=case(
                    (Node.acked_generation < generation, generation), else_=Node.acked_generation
                ),
                push_claimed_until=None,
                push_attempts=0,
                next_push_at=None,
                last_error=None,
            )
            .execution_options(synchronize_session=False)
        )


def _applied_generation(text: str) -> int | None:
    """``applied_generation`` of an agent's answer, or None if it has none."""
    try:
        value = json.loads(text)["applied_generation"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
