"""Soak: a training job checkpoints every step for STEPS steps on a 3-node cluster (tiered storage,
an S3 tier on moto's server, ``NodeRecovery: Automatic``) while faults are injected at random from
a seeded schedule; it ends with a verified restore of the newest complete step and prints a
summary: the seed, the faults by kind, the restores and the tiers that served them, the steps
lost, the wall time.

The seed is ``HPSIM_SOAK_SEED`` (default DEFAULT_SEED), printed first with the schedule drawn from
it; ``HPSIM_SOAK_SEED=12 .venv/bin/python -m pytest tests/test_soak.py -s`` replays a schedule
(the timing of each run differs; the schedule does not).

The job: one rank in this process (world size 1: ``dcp.save`` with the SDK's writer, no process
group) whose state is a function of the step (``tests.sdk_worker.training_state``), so a restored
state is checked exactly. It runs on one node and saves through that node's agent. Like a pod, it
goes down with its node or its agent: when a save fails, or its node is no longer Running, it is
restarted: it waits for the cluster to be whole again, is scheduled on a live node (chosen by the
seeded generator), loads the newest complete step through that node's agent, checks it, and
trains on from there.

Faults: the FAULTS table (node faults, S3 faults, the control plane's DatabaseOutage and
DatabaseHang). A node
fault is injected only while the cluster is whole (every node Running, its agent answering, the
replica ring complete and every replica sent): one replica per shard rides out one node failure at
a time, not two. The others come at any time. Each fault is injected either just before a step's
save or while it runs.

What a user would notice, asserted:

- training reaches the last step, and the final restore is that step, equal to its state;
- every restore is exactly the state of the step it reports, never a step that was not saved;
- a save fails only when the job's own node or agent was hit: S3 faults, a database outage or
  hang and faults on other nodes never fail a save, and no node is failed that no fault hit;
- a restart loses at most one step: the last save before the job's node went down (or before the
  job saw it leave Running: it looks after every save) may have completed there before its replica
  was sent; replication is asynchronous, milliseconds behind each save, and every earlier step had
  its replica, since the cluster was whole when the fault came;
- every fault injected is in the cluster's events, and every one that stays in force ends;
- S3 persistence catches up once the S3 faults are over: the last step is on S3.

Bounded: STEPS steps, MAX_FAULTS faults, every wait and every save or restore under a deadline,
the whole run under WALL_LIMIT_S; past a deadline it fails saying what it was waiting for.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save

from hyperpod_sim.sdk.checkpoint import Loaded, TieredCheckpointConfig, TieredStorageWriter, load_latest
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import ControlPlane, wait_for
from tests.s3_checkpoints import markers, s3_through_proxy, set_policy
from tests.s3proxy import FaultyS3Proxy
from tests.sdk_worker import same, training_state
from tests.tier import cluster

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    # One process, no process group: DCP says so on every save and load.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

STEPS = 300
MAX_FAULTS = 20
DEFAULT_SEED = 291
NODES = 3
PERSIST_EVERY_STEPS = 10
FIRST_FAULT_STEP = 10  # a few complete steps before the first fault
WALL_LIMIT_S = 240.0  # the whole run (pytest-timeout stops everything at 300 s)
CALL_LIMIT_S = 60.0  # one save or restore (a hang lasts 10 s at most; a replacement takes seconds)
WAIT_LIMIT_S = 90.0  # one wait on the cluster (a node replaced, a fault ended, S3 caught up)
CLUSTER = "soak"
NAMESPACE = "soak-job"
TEMPLATE_STEP = STEPS + 1000  # a state of the right structure whose values no saved step has
# A node fails when its agent is silent this long. The faults meant to be ridden out last 1 or 2 s
# and those meant to fail a node 10 s: 4 s either side, so that a slow moment of a loaded machine
# (CI's two cores run the control plane, moto, the job and three agents) neither fails a node that
# no fault hit nor saves one that a long fault should fail. (At 3 s, with 1 s either side, a node
# was once failed that no fault had hit.)
HEARTBEAT_TIMEOUT_S = 6.0


# ---------------------------------------------------------------------- the fault table


NODE, CLUSTER_WIDE, CONTROL_PLANE = "node", "cluster", "control plane"


@dataclass(frozen=True)
class FaultKind:
    """A row of the fault table. ``scope``: NODE faults act on one node (its ``InstanceId`` is
    resolved when the fault is injected, from the role drawn for it) and wait for the cluster to
    be whole; CLUSTER_WIDE ones act on every agent (S3); CONTROL_PLANE ones on the control plane
    itself (``inject_control_plane_fault``). ``draw`` makes the other members from the seeded
    generator. ``lasts``: it stays in force until an end event (an AgentCrash is over at once)."""

    type: str
    weight: int
    scope: str
    draw: Callable[[random.Random], dict[str, Any]]
    lasts: bool = True


@pytest.fixture
def agent_settings(proxy: FaultyS3Proxy, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """S3: moto's server behind the test proxy (tests/plugins/s3.py), the agents signing with dummy
    credentials; the S3 faults under test are injected in the agents' own S3 clients."""
    provisioning = {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}
    return {**s3_through_proxy(proxy, monkeypatch), "provisioning": provisioning}


def duration(*choices: int) -> Callable[[random.Random], dict[str, Any]]:
    return lambda rng: {"DurationSeconds": rng.choice(choices)}


FAULTS = (
    FaultKind("AgentCrash", 2, NODE, lambda rng: {}, lasts=False),
    FaultKind("NodeLoss", 2, NODE, lambda rng: {}),
    # 1 or 2 s a node rides out; 10 s, past HEARTBEAT_TIMEOUT_S, fail it, and it is replaced.
    FaultKind("AgentHang", 2, NODE, duration(1, 2, 10)),
    FaultKind("NetworkPartition", 2, NODE, duration(1, 2, 10)),  # from the control plane only
    FaultKind(
        "S3Latency",
        1,
        CLUSTER_WIDE,
        lambda rng: {"LatencyMs": rng.choice([100, 500, 2000]), "DurationSeconds": rng.randint(1, 4)},
    ),
    FaultKind(
        "S3Errors",
        1,
        CLUSTER_WIDE,
        lambda rng: {
            "ErrorRate": rng.choice([0.3, 0.6, 1.0]),
            "ErrorKind": rng.choice(["Throttle", "InternalError"]),
            "DurationSeconds": rng.randint(1, 4),
        },
    ),
    FaultKind("S3Outage", 1, CLUSTER_WIDE, duration(1, 2, 4)),
    # The control plane answers 503 meanwhile: the job's saves must not notice.
    FaultKind("DatabaseOutage", 1, CONTROL_PLANE, duration(1, 2, 4)),
    # Its database holds every request without an answer; 10 s, past HEARTBEAT_TIMEOUT_S and the
    # control plane's 7 s deadline on an answer, swallows every heartbeat: no node may fail for it.
    FaultKind("DatabaseHang", 1, CONTROL_PLANE, duration(2, 4, 10)),
    # A new kind is a row here; the schedule, the loop, the events check and the summary take
    # every row as it comes (a new scope needs its branch in Soak.inject).
)
NODE_FAULTS = {k.type for k in FAULTS if k.scope == NODE}
ROLES = ("job", "job", "peer", "other")  # a node fault's target: the job's node half the time


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule."""

    step: int
    kind: FaultKind
    members: dict[str, Any]
    role: str | None  # node faults: "job" (the job's node), "peer" (its replica peer), "other"
    during_save: bool  # injected while the step's save runs, else just before it

    def describe(self) -> str:
        where = {"job": "the job's node", "peer": "its replica peer", "other": "the third node"}
        details = ", ".join(f"{k} {v}" for k, v in self.members.items())
        target = f" on {where[self.role]}" if self.role else ""
        when = "during" if self.during_save else "before"
        return f"{self.kind.type}{target}{f' ({details})' if details else ''}, {when} the save"


def schedule(rng: random.Random) -> list[Planned]:
    """MAX_FAULTS faults at distinct steps, kinds by weight, everything drawn from ``rng``."""
    steps = sorted(rng.sample(range(FIRST_FAULT_STEP, STEPS - 10), MAX_FAULTS))
    plan = []
    for step in steps:
        kind = rng.choices(FAULTS, weights=[k.weight for k in FAULTS])[0]
        role = rng.choice(ROLES) if kind.scope == NODE else None
        plan.append(Planned(step, kind, kind.draw(rng), role, rng.random() < 0.5))
    return plan


# ---------------------------------------------------------------------- bounds


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        """Seconds for the next wait: ``cap``, or what is left of the run if less."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the soak ran past its {self.seconds:g} s limit")
        return min(cap, left)


def result_within(future: Future[Any], seconds: float, what: str) -> Any:
    try:
        return future.result(timeout=seconds)
    except FutureTimeout:
        raise AssertionError(f"{what} did not return within {seconds:g} s") from None


# ---------------------------------------------------------------------- the run


@dataclass
class Injected:
    planned: Planned
    fault_id: str
    target: str | None


@dataclass
class Restore:
    why: str
    last_saved: int  # the newest step whose save had completed
    step: int  # the step restored
    node: str
    served_by: str
    seconds: float

    @property
    def lost(self) -> int:
        return max(0, self.last_saved - self.step)


@dataclass
class Soak:
    client: HyperPodClient
    seed: int
    deadline: Deadline
    rng: random.Random  # restarts: which node the job is scheduled on
    pool: ThreadPoolExecutor  # the job's saves and restores, each under a deadline
    node: str = ""  # the job's node and agent
    endpoint: str = ""
    step: int = 1  # the next step to train and save
    last_saved: int = 0
    saves: int = 0
    hits: list[Injected] = field(default_factory=list)  # faults on the job's node since it started there
    injected: list[Injected] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    broken: str | None = None  # what kept the cluster from being whole, last time it was checked
    agent_logs: Path | None = None  # <data dir>/agents: each node's agent.log, for a failure's message

    def say(self, text: str) -> None:
        print(f"[soak {time.monotonic() - self.started:6.1f} s] {text}", flush=True)

    def log_tail(self, node: str, lines: int = 30) -> str:
        log = self.agent_logs / node / "agent.log" if self.agent_logs is not None else None
        if log is None or not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def config(self) -> TieredCheckpointConfig:
        return TieredCheckpointConfig(namespace=NAMESPACE, world_size=1, agent_url=self.endpoint)

    # -- the cluster

    def running(self) -> list[dict[str, Any]]:
        """The Running nodes with an agent endpoint, in ring order."""
        return [
            n
            for n in self.client.list_nodes(CLUSTER)
            if n["InstanceStatus"]["Status"] == "Running" and (n.get("AgentStatus") or {}).get("Endpoint")
        ]

    def whole(self) -> bool:
        """Every node Running, no node fault in force, every agent answering with a complete
        replica ring and no replica left to send (else ``broken`` says what is missing)."""
        try:
            self.broken = self._missing()
        except ClusterError as exc:
            if not unavailable(exc):
                raise
            self.broken = f"the control plane answers {exc}"
        return self.broken is None

    def _missing(self) -> str | None:
        nodes = self.client.list_nodes(CLUSTER)
        statuses = {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in nodes}
        if len(nodes) != NODES or any(status != "Running" for status in statuses.values()):
            return f"nodes {statuses}"
        faults = [
            f"{f['FaultId']} {f['Type']}"
            for f in self.client.list_faults(CLUSTER)
            if f["Type"] in NODE_FAULTS
        ]
        if faults:
            return f"node faults in force: {faults}"
        for node in nodes:
            node_id, endpoint = node["InstanceId"], (node.get("AgentStatus") or {}).get("Endpoint")
            if not endpoint:
                return f"node {node_id} has no agent endpoint"
            try:
                policy = httpx.get(f"{endpoint}/v1/policy", timeout=1).json()
                metrics = httpx.get(f"{endpoint}/metrics", timeout=1).text
            except httpx.HTTPError as exc:
                return f"the agent of node {node_id} does not answer: {exc!r}"
            peers = {p["node_id"] for p in (policy.get("replication") or {}).get("peers", [])}
            if not peers or not peers <= set(statuses) - {node_id}:
                return f"node {node_id} has replica peers {sorted(peers)}, not among the other nodes"
            pending = pending_replicas(metrics)
            if pending:
                return f"node {node_id} has {pending:g} shards not yet on its replica peer"
        return None

    def wait_whole(self, why: str) -> None:
        try:
            wait_for(self.whole, timeout=self.deadline.left(WAIT_LIMIT_S), what=f"the cluster whole ({why})")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.broken}") from None

    def node_running(self) -> bool:
        """Whether the job's node is still Running (if the control plane cannot tell, during a
        DatabaseOutage, the job goes on: its pod does not depend on the control plane)."""
        try:
            status = self.client.describe_node(CLUSTER, self.node)["InstanceStatus"]["Status"]
        except ClusterError as exc:
            if exc.code == "ResourceNotFound":
                return False
            if unavailable(exc):
                return True
            raise
        return bool(status == "Running")

    # -- faults

    def target(self, role: str) -> str:
        if role == "job":
            return self.node
        # The job's node's agent now (on the shared network a crashed agent comes back on another port).
        endpoint = next(n for n in self.running() if n["InstanceId"] == self.node)["AgentStatus"]["Endpoint"]
        policy = httpx.get(f"{endpoint}/v1/policy", timeout=5).json()
        peer = str(policy["replication"]["peers"][0]["node_id"])
        if role == "peer":
            return peer
        return next(str(n["InstanceId"]) for n in self.running() if n["InstanceId"] not in (self.node, peer))

    def inject(self, planned: Planned, target: str | None) -> None:
        members = dict(planned.members, **({"InstanceId": target} if target else {}))

        def accepted() -> dict[str, Any] | None:
            try:
                if planned.kind.scope == CONTROL_PLANE:
                    return self.client.inject_control_plane_fault(Type=planned.kind.type, **members)
                return self.client.inject_fault(CLUSTER, Type=planned.kind.type, **members)
            except ClusterError as exc:
                # One S3 fault (one outage) at a time; an agent restarting; the database down.
                if exc.code == "ConflictException" or unavailable(exc):
                    return None
                raise

        fault = wait_for(
            accepted,
            timeout=self.deadline.left(WAIT_LIMIT_S),
            what=f"{planned.kind.type} to be accepted",
        )
        done = Injected(planned, fault["FaultId"], target)
        self.injected.append(done)
        if target == self.node:
            self.hits.append(done)
        on = f" -> {target}" if target else ""
        self.say(f"step {self.step}: {fault['FaultId']} {planned.describe()}{on}")

    # -- the job

    def save(self, step: int) -> None:
        save(training_state(step, 0), storage_writer=TieredStorageWriter(self.config(), step=step))

    def restart(self, why: str, *, in_flight: int) -> None:
        """The job is restarted: on a live node of the whole cluster, from the newest complete
        step, checked against the state of the step it reports."""
        hits = ", ".join(f"{h.fault_id} {h.planned.kind.type}" for h in self.hits)
        assert self.hits, (
            f"the job failed ({why}) though no fault hit its node {self.node}; its events: "
            f"{[t for t in descriptions(self.client) if self.node in t]}; its agent's log ends: "
            f"{self.log_tail(self.node)}"
        )
        self.say(f"step {self.step}: the job goes down ({why}; after {hits}); restarting it")
        self.wait_whole(f"restarting the job after {why}")
        chosen = self.rng.choice(self.running())
        self.node, self.endpoint = chosen["InstanceId"], chosen["AgentStatus"]["Endpoint"]
        template = training_state(TEMPLATE_STEP, 0)
        future = self.pool.submit(load_latest, template, self.config())
        loaded: Loaded = result_within(future, self.deadline.left(CALL_LIMIT_S), "the restore")
        assert same(template, training_state(loaded.step, 0)), (
            f"the restore of step {loaded.step} through {self.node} is not the state saved at that step"
        )
        assert loaded.step <= in_flight, f"restored step {loaded.step}, never saved (in flight: {in_flight})"
        restore = Restore(why, self.last_saved, loaded.step, self.node, loaded.served_by[0], loaded.seconds)
        self.restores.append(restore)
        self.say(
            f"restored step {loaded.step} on {self.node} from {restore.served_by} "
            f"(last saved {self.last_saved}: {restore.lost} lost)"
        )
        assert restore.lost <= 1, (
            f"the restart lost {restore.lost} steps (saved up to {self.last_saved}, restored "
            f"{loaded.step}): only the last save before the node went down may lack its replica"
        )
        self.last_saved = loaded.step
        self.step = loaded.step + 1
        self.hits = []

    def train(self, plan: list[Planned]) -> None:
        """Steps 1..STEPS, a save each, the planned faults injected on the way."""
        pending = list(plan)
        while self.step <= STEPS:
            due = pending[0] if pending and pending[0].step <= self.step else None
            if due is not None and due.kind.scope == NODE:
                self.wait_whole(f"before {due.kind.type}")
                if not self.node_running():
                    self.restart("its node was replaced", in_flight=self.last_saved)
                    continue
            # The target is resolved first, so that a fault injected during the save comes quickly.
            target = self.target(due.role) if due is not None and due.role is not None else None
            if due is not None and not due.during_save:
                self.inject(pending.pop(0), target)
            step = self.step
            future = self.pool.submit(self.save, step)
            if due is not None and due.during_save:
                self.inject(pending.pop(0), target)
            try:
                result_within(future, self.deadline.left(CALL_LIMIT_S), f"the save of step {step}")
            except (Exception, CheckpointException) as exc:  # the latter is a BaseException
                self.restart(f"the save of step {step} failed: {cause(exc)}", in_flight=step)
                continue
            self.saves += 1
            self.last_saved = step
            self.step = step + 1
            if not self.node_running():  # the job goes down with its node
                self.restart(f"its node {self.node} is no longer Running", in_flight=step)

    def summary(self, wall_s: float) -> str:
        by_kind = Counter(i.planned.kind.type for i in self.injected)
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items()))
        tiers = Counter(r.served_by for r in self.restores)
        lines = [
            f"=== soak summary (seed {self.seed}) ===",
            f"steps:           {self.last_saved} of {STEPS} ({self.saves} saves, every step)",
            f"faults injected: {len(self.injected)} ({kinds})",
            f"faults survived: {len(self.injected) if self.last_saved == STEPS else 'run failed'}",
            f"restores:        {len(self.restores)}, every one verified "
            f"({', '.join(f'{t} {n}' for t, n in sorted(tiers.items())) or 'none'})",
        ]
        for r in self.restores:
            lines.append(
                f"  step {r.step} (last saved {r.last_saved}, {r.lost} lost) from {r.served_by} "
                f"on {r.node} in {r.seconds:.2f} s: {r.why}"
            )
        lines += [
            f"steps lost:      {sum(r.lost for r in self.restores)} in total",
            f"wall time:       {wall_s:.1f} s",
        ]
        return "\n".join(lines)


def unavailable(exc: ClusterError) -> bool:
    """The control plane answered 503 (its database is down)."""
    return exc.status == 503


def cause(exc: BaseException) -> str:
    """One line for a failed save (DCP wraps each rank's exception with its traceback)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(cause(failure) for failure, _ in exc.failures.values())
    return f"{type(exc).__name__}: {exc}"[:200]


def pending_replicas(metrics: str) -> float:
    """``hpsim_tier_replication_pending`` of an agent's /metrics: shards not yet on every peer."""
    for line in metrics.splitlines():
        if line.startswith("hpsim_tier_replication_pending "):
            return float(line.split()[1])
    raise AssertionError("the agent reports no hpsim_tier_replication_pending")


def descriptions(client: HyperPodClient) -> list[str]:
    return [e["Description"] for e in client.events(CLUSTER)]


@pytest.mark.timeout(WALL_LIMIT_S + 60)
def test_training_rides_out_random_faults(
    agent_plane: ControlPlane, s3: Any, bucket: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("HPSIM_SOAK_SEED", DEFAULT_SEED))
    plan = schedule(random.Random(seed))
    print(f"\nsoak seed {seed} (HPSIM_SOAK_SEED): {STEPS} steps, a checkpoint each, {len(plan)} faults:")
    for planned in plan:
        print(f"  step {planned.step:3d}  {planned.describe()}")
    sm = agent_plane.client()
    with HyperPodClient(agent_plane.url) as client, ThreadPoolExecutor(1, "soak-job") as pool:
        soak = Soak(client, seed, Deadline(WALL_LIMIT_S), random.Random(f"{seed}-restarts"), pool)
        soak.agent_logs = tmp_path / "data" / "agents"
        try:
            cluster(sm, agent_plane, CLUSTER, NODES)
            set_policy(
                agent_plane,
                sm,
                CLUSTER,
                S3BaseUri=f"s3://{bucket}/soak",
                PersistEverySteps=PERSIST_EVERY_STEPS,
            )
            first = soak.rng.choice(soak.running())
            soak.node, soak.endpoint = first["InstanceId"], first["AgentStatus"]["Endpoint"]
            soak.say(f"cluster {CLUSTER} InService; the job starts on {soak.node}")
            soak.train(plan)

            # The newest complete step is the last one saved, exactly as saved.
            template = training_state(TEMPLATE_STEP, 0)
            future = pool.submit(load_latest, template, soak.config())
            final: Loaded = result_within(future, soak.deadline.left(CALL_LIMIT_S), "the final restore")
            assert final.step == STEPS, f"the newest complete step is {final.step}, not {STEPS}"
            assert same(template, training_state(STEPS, 0))
            soak.say(f"final restore: step {final.step} from {final.served_by[0]}, verified")

            # Every fault is in the events; every one that stays in force has ended.
            def ended() -> bool:
                try:
                    texts = descriptions(client)
                except ClusterError as exc:
                    if unavailable(exc):  # a DatabaseOutage still in force
                        return False
                    raise
                return all(
                    any(t.startswith(f"Fault {i.fault_id} ended: {i.planned.kind.type}") for t in texts)
                    for i in soak.injected
                    if i.planned.kind.lasts
                )

            try:
                wait_for(ended, timeout=soak.deadline.left(WAIT_LIMIT_S), what="every fault to end")
            except AssertionError as exc:
                texts = descriptions(client)
                open_faults = [
                    f"{i.fault_id} {i.planned.kind.type} -> {i.target}"
                    for i in soak.injected
                    if i.planned.kind.lasts
                    and not any(t.startswith(f"Fault {i.fault_id} ended: ") for t in texts)
                ]
                raise AssertionError(f"{exc}: {open_faults}; events: {texts[:40]}") from None
            assert client.list_faults(CLUSTER) == []
            assert client.list_control_plane_faults() == []
            texts = descriptions(client)
            missing = [
                f"{i.fault_id} {i.planned.kind.type}"
                for i in soak.injected
                if not any(t.startswith(f"Fault {i.fault_id} injected: {i.planned.kind.type}") for t in texts)
            ]
            assert not missing, f"faults injected but not in the cluster's events: {missing}"
            # No node failed that no node fault hit (a database outage or hang fails none).
            hit = {i.target for i in soak.injected if i.target is not None}
            failed = {t.split()[1] for t in texts if t.startswith("Node ") and " failed: " in t}
            assert failed <= hit, f"nodes failed that no fault hit: {failed - hit}: {texts}"
            # S3 caught up after the S3 faults: the last step (a due one) is on S3.
            assert STEPS % PERSIST_EVERY_STEPS == 0
            wait_for(
                lambda: STEPS in markers(s3, bucket, f"soak/{NAMESPACE}/"),
                timeout=soak.deadline.left(WAIT_LIMIT_S),
                what=f"step {STEPS} on S3",
            )
        finally:
            print(soak.summary(time.monotonic() - soak.started), flush=True)
    assert [i.planned for i in soak.injected] == plan  # every fault planned came, once
