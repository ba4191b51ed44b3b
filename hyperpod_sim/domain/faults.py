"""Fault injection: hyperpod-sim's extension for testing how a cluster and its trainers ride out
failures (REST ``/clusters/{name}/faults``, the SDK's ``inject_fault``, ``hyperpod-sim fault``).

Node faults act on a node's agent process, so they need the local provisioner, which owns those
processes:

- ``AgentCrash``: SIGKILL of the agent. Its shared memory stays, as a daemon's does on a real node;
  the reconciler restarts a crashed agent of a Pending or Running node (as a kubelet restarts a
  daemon), and the restarted agent finds its shards again and re-sends the replicas its peers lack.
  Instantaneous: it is over once injected, and not listed as active.
- ``NodeLoss``: SIGKILL of the agent and its node's shared memory wiped (a hardware failure). The
  fault stays active, and the agent is not restarted, until the control plane has failed the node
  (no heartbeat for ``heartbeat_timeout_s``); then ``NodeRecovery: Automatic`` replaces it.
- ``AgentHang``: SIGSTOP of the agent for ``DurationSeconds``, then SIGCONT. Its port stays open
  and answers nothing; past the heartbeat timeout the control plane fails the node, and replaces
  it with ``NodeRecovery: Automatic`` (the replaced node's agent is stopped) or, with ``None``,
  sees it recover when the agent heartbeats again.
- ``NetworkPartition``: the node and the control plane cannot reach each other for
  ``DurationSeconds`` (a firewall rule on the node, contracts/partition.py); trainers, peer agents and
  S3 still reach it, so checkpointing goes on. The control plane cannot tell this from a dead node:
  past the heartbeat timeout it fails the node and, with ``Automatic``, replaces it; with ``None``
  the node recovers when the partition heals and the agent's heartbeats get through again.

S3 faults act on every agent of the cluster: they travel in the node policy (``faults.s3``), so a
change bumps the policy generation and is pushed like any other; the agents apply them in their S3
client (hyperpod_sim/agents/s3/objects.py). One S3 fault at a time per cluster. ``S3Latency`` delays every
request, ``S3Errors`` answers a share of them 503 SlowDown (``Throttle``) or 500 InternalError,
``S3Outage`` fails them all. Without ``DurationSeconds`` they last until cleared.

The control plane's own fault, for testing what clients and agents see when it falters, is
service-wide (REST ``/faults``): ``DatabaseOutage`` makes this process's database unreachable for
``DurationSeconds`` (models/db.py: every statement and commit fails as if the server had gone). The
API answers 503 ServiceUnavailable in the AWS shape (botocore retries it), a transaction it
interrupts is rolled back whole, the reconciler's passes fail and are retried, and agents keep
heartbeating. When it ends, the reconciler records the end in every cluster's events and gives
nodes a heartbeat timeout's grace counted from the outage's end, so that the heartbeats the outage
swallowed do not fail them. It is held in this process only (the database cannot hold it), and
affects only this control plane.

Faults in force are stored with the cluster (its ``faults`` column), with their end time, so a
restarted control plane still ends them: the reconciler calls ``end_due_faults`` on every pass.
Each injection and each end is a cluster event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import get_args

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.contracts import simulator_api as extensions
from hyperpod_sim.contracts.policy import S3Fault
from hyperpod_sim.domain import events
from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.errors import (
    ConflictException,
    ResourceNotFound,
    ValidationException,
    echo,
    validation_error,
)
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import ClusterStatus, NodeStatus, bump_generation
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, Database, Node
from hyperpod_sim.models.db import HANG, OUTAGE, Outage
from hyperpod_sim.models.faults import (
    ClearedControlPlaneFault,
    ClearedFault,
    ControlPlaneFault,
    ErrorKind,
    Fault,
    FaultType,
    HealthFaultType,
    NodeFaultType,
    S3FaultType,
)

NODE_FAULTS: tuple[NodeFaultType, ...] = get_args(NodeFaultType)
S3_FAULTS: tuple[S3FaultType, ...] = get_args(S3FaultType)
# Faults a node's deep health check finds (domain/node_operations/health_checks.py); its agent is left alone,
# so they
# work in every provisioning mode. In force until cleared or until the node is gone.
HEALTH_FAULTS: tuple[HealthFaultType, ...] = get_args(HealthFaultType)
# The model's FaultType enum (contracts/simulator_api.json), in its order; a test holds them equal.
FAULT_TYPES: tuple[FaultType, ...] = (*NODE_FAULTS, *S3_FAULTS, *HEALTH_FAULTS)
CONTROL_PLANE_FAULTS = (OUTAGE, HANG)  # the model's ControlPlaneFaultType enum, in its order
ERROR_KINDS: tuple[ErrorKind, ...] = get_args(ErrorKind)
DEFAULT_ERROR_KIND: ErrorKind = "Throttle"
# Cluster statuses in which faults are accepted: the cluster runs, whether or not a rollout is on.
ACCEPTING = (ClusterStatus.IN_SERVICE, ClusterStatus.UPDATING)
LIVE = (NodeStatus.PENDING, NodeStatus.RUNNING)


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject, its members checked against the model (contracts/simulator_api.json: the
    members each ``type`` takes and requires, and their limits) by the API. What no shape can
    say is checked here: an ``error_rate`` above 0."""

    type: FaultType
    instance_id: str | None = None
    duration_s: int | None = None
    latency_ms: int | None = None
    error_rate: float | None = None
    error_kind: ErrorKind | None = None

    def __post_init__(self) -> None:
        """What the domain relies on, for callers other than the API too: a type and error kind of
        the model's, the members the type's shape requires set, and an ``error_rate`` above 0
        (which no shape can say)."""
        if self.type not in FAULT_TYPES:
            raise validation_error([_not_one_of("type", self.type, FAULT_TYPES)])
        errors = [
            f"Value null at '{member[0].lower() + member[1:]}' failed to satisfy constraint: "
            "Member must not be null"
            for member, field in _FIELDS.items()
            if getattr(self, field) is None and member in _required(self.type)
        ]
        if self.error_kind is not None and self.error_kind not in ERROR_KINDS:
            errors.append(_not_one_of("errorKind", self.error_kind, ERROR_KINDS))
        if self.error_rate is not None and not self.error_rate > 0:
            errors.append(
                f"Value '{echo(self.error_rate)}' at 'errorRate' failed to satisfy constraint: "
                "Member must have value greater than 0"
            )
        if errors:
            raise validation_error(errors)


# Wire member -> FaultSpec field.
_FIELDS = {
    "InstanceId": "instance_id",
    "DurationSeconds": "duration_s",
    "LatencyMs": "latency_ms",
    "ErrorRate": "error_rate",
}


def _required(kind: str) -> tuple[str, ...]:
    """The members a fault type requires: its input shape's, in the extensions model."""
    return extensions.required(f"{kind}InjectFaultRequest")


def _not_one_of(member: str, value: object, allowed: tuple[str, ...]) -> str:
    """The API's message for a value outside an enum of the model."""
    return (
        f"Value '{echo(value)}' at '{member}' failed to satisfy constraint: Member must satisfy enum "
        f"value set: [{', '.join(allowed)}]"
    )


# ---------------------------------------------------------------------- stored faults


def in_force(cluster: Cluster) -> list[Fault]:
    """The faults in force (the ``faults`` column), oldest first."""
    return list(cluster.faults or [])


def on_node(cluster: Cluster, node_id: str) -> Fault | None:
    """The fault in force on a node (at most one at a time)."""
    return next((f for f in in_force(cluster) if f.instance_id == node_id), None)


def lost_nodes(cluster: Cluster) -> set[str]:
    """Nodes with a NodeLoss in force: their agent is not to be restarted."""
    return {f.instance_id for f in in_force(cluster) if f.type == "NodeLoss" and f.instance_id is not None}


def failing_health_checks(cluster: Cluster) -> set[str]:
    """Nodes with a DeepHealthCheckFailure in force: their deep health checks fail."""
    return {f.instance_id for f in in_force(cluster) if f.type in HEALTH_FAULTS and f.instance_id is not None}


def s3_fault_policy(cluster: Cluster) -> S3Fault | None:
    """The ``faults.s3`` member of the node policy: what the agents apply to their S3 requests."""
    fault = next((f for f in in_force(cluster) if f.type in S3_FAULTS), None)
    if fault is None:
        return None
    return S3Fault(
        fault_id=fault.fault_id,
        type=fault.type,
        latency_ms=fault.latency_ms,
        error_rate=fault.error_rate,
        error_kind=fault.error_kind,
        outage=fault.type == "S3Outage",
        until=fault.ends_at,
    )


def _describe(fault: Fault) -> str:
    kind = fault.type
    what = f"{kind} on node {fault.instance_id}" if kind in (*NODE_FAULTS, *HEALTH_FAULTS) else kind
    details = []
    if fault.latency_ms is not None:
        details.append(f"{fault.latency_ms} ms per S3 request")
    if fault.error_rate is not None:
        code = "503 SlowDown" if fault.error_kind == "Throttle" else "500 InternalError"
        details.append(f"{fault.error_rate:g} of S3 requests answered {code}")
    if kind == "S3Outage":
        details.append("every S3 request fails with 503")
    if fault.duration_seconds is not None:
        details.append(f"for {fault.duration_seconds} s")
    elif kind in S3_FAULTS:
        details.append("until cleared")
    return f"{what} ({', '.join(details)})" if details else what


def _end(session: Session, *, ids: Ids, now: datetime, cluster: Cluster, fault: Fault, reason: str) -> None:
    """Drop a fault from the cluster's list (the caller does what ending it takes) with an event."""
    cluster.faults = [f for f in in_force(cluster) if f.fault_id != fault.fault_id]
    node = _node(cluster, fault.instance_id)
    description = f"Fault {fault.fault_id} ended: {_describe(fault)}; {reason}."
    if fault.type in S3_FAULTS:
        bump_generation(cluster)
        description += f" Policy generation {cluster.generation}."
    events.record(session, ids=ids, now=now, cluster=cluster, node=node, description=description)


def _node(cluster: Cluster, node_id: str | None) -> Node | None:
    if node_id is None:
        return None
    return next((n for n in cluster.nodes if n.id == node_id), None)


# Node faults that last a while and are undone when they end.
_UNDONE = ("AgentHang", "NetworkPartition")


def _undo(provisioner: Provisioner, node: Node, fault: Fault) -> None:
    if fault.type == "AgentHang":
        provisioner.resume_agent(node)
    elif fault.type == "NetworkPartition":
        provisioner.heal_agent(node)


def end_due_faults(
    session: Session, *, ids: Ids, now: datetime, cluster: Cluster, provisioner: Provisioner
) -> tuple[bool, datetime | None]:
    """One reconcile step: end the faults whose time is up or whose node the control plane has
    dealt with. Returns whether anything changed and when the next fault is due to end."""
    changed = False
    due: datetime | None = None
    epoch = now.timestamp()
    for fault in in_force(cluster):
        node = _node(cluster, fault.instance_id)
        ends_at = fault.ends_at
        if fault.type == "NodeLoss" and (node is None or node.status not in LIVE):
            state = "gone" if node is None else node.status
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=f"the node is {state}")
        elif fault.type in HEALTH_FAULTS and (node is None or node.status == NodeStatus.SHUTTING_DOWN):
            state = "gone" if node is None else "shutting down"
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=f"the node is {state}")
        elif fault.type in _UNDONE and (node is None or node.status == NodeStatus.SHUTTING_DOWN):
            # A replaced or deleted node's agent was sent SIGTERM and SIGCONT by its provisioner; a
            # partition is healed so that its agent can say goodbye to the control plane.
            if node is not None:
                _undo(provisioner, node, fault)
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason="the node is shutting down")
        elif ends_at is not None and ends_at <= epoch:
            if node is not None:
                _undo(provisioner, node, fault)
            reason = f"its {fault.duration_seconds} s passed"
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=reason)
        else:
            if ends_at is not None:
                when = datetime.fromtimestamp(ends_at, tz=UTC)
                due = when if due is None else min(due, when)
            continue
        changed = True
    return changed, due


# ---------------------------------------------------------------------- the service


@dataclass(kw_only=True, eq=False)
class FaultService(DomainService):
    """Inject, list and clear faults. Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    provisioner: Provisioner
    provisioning_mode: str

    def _cluster(self, session: Session, name: str, *, lock: bool = False) -> Cluster:
        return get_cluster(session, name, selectinload(Cluster.nodes), lock=lock)

    def inject_fault(self, *, name: str, spec: FaultSpec) -> tuple[Cluster, Fault]:
        """Inject one fault now; the cluster (its policy generation as the fault left it) and the
        fault (its id, the members given, when it was injected and, with a duration, ends)."""
        node_fault = spec.type in NODE_FAULTS
        if node_fault and not self.provisioner.owns_agents:
            raise ValidationException(
                f"Fault type '{spec.type}' acts on a node's agent process, which only the local "
                f"provisioner owns; this control plane provisions nodes in '{self.provisioning_mode}' "
                "mode (HPSIM_PROVISIONING__MODE=local for node faults). S3 faults work in every mode."
            )
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster(session, name, lock=True)
            # What is due to end ends first (the reconciler may not have passed since).
            end_due_faults(session, ids=self.ids, now=now, cluster=cluster, provisioner=self.provisioner)
            if cluster.status not in ACCEPTING:
                raise ConflictException(
                    f"Cluster '{cluster.name}' is {cluster.status}; faults can be injected only while it is "
                    "InService or Updating."
                )
            current = in_force(cluster)
            fault = Fault(
                fault_id=self.ids.fault_id(),
                type=spec.type,
                instance_id=spec.instance_id,
                duration_seconds=spec.duration_s,
                latency_ms=spec.latency_ms,
                error_rate=spec.error_rate,
                error_kind=(spec.error_kind or DEFAULT_ERROR_KIND) if spec.error_rate is not None else None,
                injected_at=now.timestamp(),
                ends_at=now.timestamp() + spec.duration_s if spec.duration_s is not None else None,
            )
            node = None
            if node_fault:
                node = self._live_node(cluster, spec)
                detail = self._act_on_node(node, fault)
            elif spec.type in HEALTH_FAULTS:
                node = self._live_node(cluster, spec)
                detail = "its deep health checks fail while it is in force (StartClusterHealthCheck)"
            else:
                running = next((f for f in current if f.type in S3_FAULTS), None)
                if running is not None:
                    raise ConflictException(
                        f"Fault {running.fault_id} ({running.type}) is in force on cluster "
                        f"'{cluster.name}'; one S3 fault at a time: clear it first."
                    )
                bump_generation(cluster)
                detail = f"policy generation {cluster.generation}"
            if spec.type != "AgentCrash":  # a crash is over once injected: nothing stays in force
                cluster.faults = [*current, fault]
            events.record(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                node=node,
                level=Level.WARN,
                description=f"Fault {fault.fault_id} injected: {_describe(fault)}; {detail}.",
            )
        self.on_change()
        return cluster, fault

    def _live_node(self, cluster: Cluster, spec: FaultSpec) -> Node:
        node = _node(cluster, spec.instance_id)
        if node is None or node.status == NodeStatus.SHUTTING_DOWN:
            raise ResourceNotFound(f"Node '{spec.instance_id}' does not exist in cluster '{cluster.name}'.")
        if node.status not in LIVE:
            raise ConflictException(
                f"Node {node.id} is {node.status}; node faults are injected into Pending or Running nodes."
            )
        held = on_node(cluster, node.id)
        if held is not None:
            raise ConflictException(
                f"Fault {held.fault_id} ({held.type}) is in force on node {node.id}; clear it or wait "
                "for it to end first."
            )
        return node

    def _act_on_node(self, node: Node, fault: Fault) -> str:
        """Signal the node's agent (inside the transaction that records the fault: the reconciler,
        which holds the same lock, never sees the agent gone without the fault)."""
        kind = fault.type
        if kind == "NetworkPartition":
            assert fault.ends_at is not None  # FaultSpec holds its required DurationSeconds
            pids = self.provisioner.partition_agent(node, fault_id=fault.fault_id, until=fault.ends_at)
            agent = f"agent pid {', '.join(map(str, pids))}" if pids else "the node's agent (restarting)"
            return (
                f"{agent} and the control plane can no longer reach each other; trainers and peer "
                "agents still can"
            )
        if kind == "AgentHang":
            pids = self.provisioner.pause_agent(node)
            action = "stopped with SIGSTOP"
        else:
            pids = self.provisioner.kill_agent(node, wipe_memory=kind == "NodeLoss")
            action = "killed with SIGKILL"
        if not pids and kind != "NodeLoss":
            raise ConflictException(
                f"Node {node.id} has no agent process right now (it is starting or restarting); "
                "retry shortly."
            )
        agent = f"agent pid {', '.join(map(str, pids))} {action}" if pids else "no agent process was running"
        memory = "its shared memory wiped" if kind == "NodeLoss" else "its shared memory kept"
        return f"{agent}, {memory}"

    def list_faults(self, *, name: str) -> tuple[Cluster, list[Fault]]:
        """The faults in force, oldest first (those past their end, not yet ended by the reconciler,
        are left out)."""
        epoch = self.clock.now().timestamp()
        with self.db.read() as session:
            cluster = self._cluster(session, name)
            found = [f for f in in_force(cluster) if f.ends_at is None or f.ends_at > epoch]
            return cluster, found

    def clear_fault(self, *, name: str, fault_id: str) -> tuple[Cluster, ClearedFault]:
        """End an S3 fault or a hang now. A NodeLoss cannot be undone: it ends when the node fails."""
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster(session, name, lock=True)
            end_due_faults(session, ids=self.ids, now=now, cluster=cluster, provisioner=self.provisioner)
            fault = next((f for f in in_force(cluster) if f.fault_id == fault_id), None)
            if fault is None:
                raise ResourceNotFound(f"Fault '{fault_id}' is not in force in cluster '{cluster.name}'.")
            if fault.type == "NodeLoss":
                raise ValidationException(
                    f"Fault {fault_id} (NodeLoss) cannot be cleared: the node's memory is gone. It ends when "
                    "the control plane has failed the node."
                )
            node = _node(cluster, fault.instance_id)
            if node is not None:
                _undo(self.provisioner, node, fault)
            _end(session, ids=self.ids, now=now, cluster=cluster, fault=fault, reason="cleared")
        self.on_change()
        return cluster, ClearedFault(**dict(fault), cleared_at=now.timestamp())

    # ------------------------------------------------------------------ the control plane's own

    def inject_control_plane_fault(self, *, duration_s: int, kind: str = OUTAGE) -> ControlPlaneFault:
        """Start a DatabaseOutage or a DatabaseHang of ``duration_s`` seconds now (its injection
        recorded in every cluster's events first, while the database still answers)."""
        if kind not in CONTROL_PLANE_FAULTS:
            raise ValidationException(_not_one_of("type", kind, CONTROL_PLANE_FAULTS))
        running = self._running_outage()
        if running is not None:
            raise ConflictException(
                f"Fault {running.fault_id} ({running.kind}) is in force; one at a time: clear it first."
            )
        # One that has run its time but that the reconciler has not reported yet ends first, or
        # the new one would take its place and its end never be recorded.
        report_ended_outage(db=self.db, clock=self.clock, ids=self.ids)
        now = self.clock.now()
        fault_id = self.ids.fault_id()
        description = (
            f"Fault {fault_id} injected: {_what(kind, duration_s)}; the control plane answers 503 "
            "ServiceUnavailable until it ends"
            + (
                f" (a request whose database answer does not come within {self.db.timeouts.answer_s:g} s)."
                if kind == HANG
                else "."
            )
        )
        with self.db.write() as session:
            for cluster in session.scalars(select(Cluster)):
                events.record(
                    session, ids=self.ids, now=now, cluster=cluster, level=Level.WARN, description=description
                )
        outage = self.db.begin_outage(fault_id=fault_id, duration_s=duration_s, kind=kind)
        return _outage_fault(outage)

    def _running_outage(self) -> Outage | None:
        outage = self.db.outage()
        return outage if outage is not None and outage.ended_at is None else None

    def list_control_plane_faults(self) -> list[ControlPlaneFault]:
        """The control-plane faults in force (no database needed)."""
        outage = self._running_outage()
        return [_outage_fault(outage)] if outage is not None else []

    def clear_control_plane_fault(self, *, fault_id: str) -> ClearedControlPlaneFault:
        """End a DatabaseOutage or DatabaseHang now; its end is recorded in every cluster's events
        (the statements a hang holds go on at once)."""
        current = self._running_outage()
        if current is None or current.fault_id != fault_id:
            raise ResourceNotFound(f"Fault '{fault_id}' is not in force in this control plane.")
        outage = self.db.end_outage(fault_id=fault_id)
        if outage is None:  # it ended by itself meanwhile, and was reported
            raise ResourceNotFound(f"Fault '{fault_id}' is not in force in this control plane.")
        _report_outage(db=self.db, clock=self.clock, ids=self.ids, outage=outage, reason="cleared")
        self.on_change()
        assert outage.ended_at is not None  # end_outage has set it
        return ClearedControlPlaneFault(**dict(_outage_fault(outage)), cleared_at=outage.ended_at)


def report_ended_outage(*, db: Database, clock: Clock, ids: Ids) -> bool:
    """The reconciler's part: once a DatabaseOutage or DatabaseHang has run its time and the database answers
    again, record its end in every cluster's events and forget it. Whether one was reported."""
    outage = db.outage()
    if outage is None or outage.ended_at is None:
        return False
    _report_outage(db=db, clock=clock, ids=ids, outage=outage, reason=f"its {outage.duration_s:g} s passed")
    db.end_outage(fault_id=outage.fault_id)
    return True


def _what(kind: str, duration_s: float) -> str:
    if kind == HANG:
        silent = "every database request waits for an answer that does not come"
        return f"DatabaseHang ({silent}, for {duration_s:g} s)"
    return f"DatabaseOutage (every database request fails, for {duration_s:g} s)"


def _report_outage(*, db: Database, clock: Clock, ids: Ids, outage: Outage, reason: str) -> None:
    now = clock.now()
    refused = "1 request" if outage.refused == 1 else f"{outage.refused} requests"
    meanwhile = f"{refused} to the database failed meanwhile"
    if outage.kind == HANG:
        held = "1 was" if outage.held == 1 else f"{outage.held} were"
        meanwhile += f" and {held} answered late"
    description = (
        f"Fault {outage.fault_id} ended: {_what(outage.kind, outage.duration_s)}; {reason}. {meanwhile}; "
        "reconciliation resumed."
    )
    with db.write() as session:
        for cluster in session.scalars(select(Cluster)):
            events.record(session, ids=ids, now=now, cluster=cluster, description=description)


def _outage_fault(outage: Outage) -> ControlPlaneFault:
    return ControlPlaneFault(
        fault_id=outage.fault_id,
        type=outage.kind,
        duration_seconds=int(outage.duration_s),
        injected_at=outage.started_at,
        ends_at=outage.started_at + outage.duration_s,
    )
