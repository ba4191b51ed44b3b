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
client (hyperpod_sim/agents/s3objects.py). One S3 fault at a time per cluster. ``S3Latency`` delays every
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

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.contracts import extensions
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
from hyperpod_sim.models import Cluster, Database, Node
from hyperpod_sim.models.db import Outage

NODE_FAULTS = ("AgentCrash", "NodeLoss", "AgentHang", "NetworkPartition")
S3_FAULTS = ("S3Latency", "S3Errors", "S3Outage")
# Faults a node's deep health check finds (domain/health_checks.py); its agent is left alone, so they
# work in every provisioning mode. In force until cleared or until the node is gone.
HEALTH_FAULTS = ("DeepHealthCheckFailure",)
# The model's FaultType enum (hyperpod_sim/contracts/extensions.json), in its order; a test holds them equal.
FAULT_TYPES = (*NODE_FAULTS, *S3_FAULTS, *HEALTH_FAULTS)
CONTROL_PLANE_FAULTS = ("DatabaseOutage",)
DEFAULT_ERROR_KIND = "Throttle"
# Cluster statuses in which faults are accepted: the cluster runs, whether or not a rollout is on.
ACCEPTING = (ClusterStatus.IN_SERVICE, ClusterStatus.UPDATING)
LIVE = (NodeStatus.PENDING, NodeStatus.RUNNING)


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject, its members checked against the model (hyperpod_sim/contracts/extensions.json: the
    members each ``type`` takes and requires, and their limits) by the API. What no shape can
    say is checked here: an ``error_rate`` above 0."""

    type: str
    instance_id: str | None = None
    duration_s: int | None = None
    latency_ms: int | None = None
    error_rate: float | None = None
    error_kind: str | None = None

    def __post_init__(self) -> None:
        """What the domain relies on, for callers other than the API too: the members the type's
        shape requires are set, and an ``error_rate`` is above 0 (which no shape can say)."""
        errors = [
            f"Value null at '{member[0].lower() + member[1:]}' failed to satisfy constraint: "
            "Member must not be null"
            for member, field in _FIELDS.items()
            if getattr(self, field) is None and self.type in FAULT_TYPES and member in _required(self.type)
        ]
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


# ---------------------------------------------------------------------- stored faults


def active_faults(cluster: Cluster) -> list[dict[str, Any]]:
    """The faults in force, in their wire shape (the ``faults`` column)."""
    return list(cluster.faults or [])


def lost_nodes(cluster: Cluster) -> set[str]:
    """Nodes with a NodeLoss in force: their agent is not to be restarted."""
    return {f["InstanceId"] for f in active_faults(cluster) if f["Type"] == "NodeLoss"}


def failing_health_checks(cluster: Cluster) -> set[str]:
    """Nodes with a DeepHealthCheckFailure in force: their deep health checks fail."""
    return {f["InstanceId"] for f in active_faults(cluster) if f["Type"] in HEALTH_FAULTS}


def s3_fault_document(cluster: Cluster) -> dict[str, Any] | None:
    """The ``faults.s3`` member of the node policy: what the agents apply to their S3 requests."""
    fault = next((f for f in active_faults(cluster) if f["Type"] in S3_FAULTS), None)
    if fault is None:
        return None
    return {
        "fault_id": fault["FaultId"],
        "type": fault["Type"],
        "latency_ms": fault.get("LatencyMs"),
        "error_rate": fault.get("ErrorRate"),
        "error_kind": fault.get("ErrorKind"),
        "outage": fault["Type"] == "S3Outage",
        "until": fault.get("EndsAt"),
    }


def _describe(fault: dict[str, Any]) -> str:
    kind = fault["Type"]
    what = f"{kind} on node {fault['InstanceId']}" if kind in (*NODE_FAULTS, *HEALTH_FAULTS) else kind
    details = []
    if "LatencyMs" in fault:
        details.append(f"{fault['LatencyMs']} ms per S3 request")
    if "ErrorRate" in fault:
        code = "503 SlowDown" if fault["ErrorKind"] == "Throttle" else "500 InternalError"
        details.append(f"{fault['ErrorRate']:g} of S3 requests answered {code}")
    if kind == "S3Outage":
        details.append("every S3 request fails with 503")
    if "DurationSeconds" in fault:
        details.append(f"for {fault['DurationSeconds']} s")
    elif kind in S3_FAULTS:
        details.append("until cleared")
    return f"{what} ({', '.join(details)})" if details else what


def _end(
    session: Session, *, ids: Ids, now: datetime, cluster: Cluster, fault: dict[str, Any], reason: str
) -> None:
    """Drop a fault from the cluster's list (the caller does what ending it takes) with an event."""
    cluster.faults = [f for f in active_faults(cluster) if f["FaultId"] != fault["FaultId"]]
    node = _node(cluster, fault.get("InstanceId"))
    description = f"Fault {fault['FaultId']} ended: {_describe(fault)}; {reason}."
    if fault["Type"] in S3_FAULTS:
        bump_generation(cluster)
        description += f" Policy generation {cluster.generation}."
    events.record(session, ids=ids, now=now, cluster=cluster, node=node, description=description)


def _node(cluster: Cluster, node_id: str | None) -> Node | None:
    if node_id is None:
        return None
    return next((n for n in cluster.nodes if n.id == node_id), None)


# Node faults that last a while and are undone when they end.
_UNDONE = ("AgentHang", "NetworkPartition")


def _undo(provisioner: Provisioner, node: Node, fault: dict[str, Any]) -> None:
    if fault["Type"] == "AgentHang":
        provisioner.resume_agent(node)
    elif fault["Type"] == "NetworkPartition":
        provisioner.heal_agent(node)


def end_due_faults(
    session: Session, *, ids: Ids, now: datetime, cluster: Cluster, provisioner: Provisioner
) -> tuple[bool, datetime | None]:
    """One reconcile step: end the faults whose time is up or whose node the control plane has
    dealt with. Returns whether anything changed and when the next fault is due to end."""
    changed = False
    due: datetime | None = None
    epoch = now.timestamp()
    for fault in active_faults(cluster):
        node = _node(cluster, fault.get("InstanceId"))
        ends_at = fault.get("EndsAt")
        if fault["Type"] == "NodeLoss" and (node is None or node.status not in LIVE):
            state = "gone" if node is None else node.status
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=f"the node is {state}")
        elif fault["Type"] in HEALTH_FAULTS and (node is None or node.status == NodeStatus.SHUTTING_DOWN):
            state = "gone" if node is None else "shutting down"
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=f"the node is {state}")
        elif fault["Type"] in _UNDONE and (node is None or node.status == NodeStatus.SHUTTING_DOWN):
            # A replaced or deleted node's agent was sent SIGTERM and SIGCONT by its provisioner; a
            # partition is healed so that its agent can say goodbye to the control plane.
            if node is not None:
                _undo(provisioner, node, fault)
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason="the node is shutting down")
        elif ends_at is not None and ends_at <= epoch:
            if node is not None:
                _undo(provisioner, node, fault)
            reason = f"its {fault['DurationSeconds']} s passed"
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason=reason)
        else:
            if ends_at is not None:
                when = datetime.fromtimestamp(ends_at, tz=UTC)
                due = when if due is None else min(due, when)
            continue
        changed = True
    return changed, due


# ---------------------------------------------------------------------- the service


class FaultService:
    """Inject, list and clear faults. Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        ids: Ids,
        provisioner: Provisioner,
        provisioning_mode: str,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.provisioner = provisioner
        self.provisioning_mode = provisioning_mode
        self.on_change = on_change

    def _cluster(self, session: Session, name: str, *, lock: bool = False) -> Cluster:
        return get_cluster(session, name, selectinload(Cluster.nodes), lock=lock)

    def inject_fault(self, *, name: str, spec: FaultSpec) -> tuple[Cluster, dict[str, Any]]:
        """Inject one fault now; its record (``FaultId``, ``Type``, the members given, ``InjectedAt``,
        ``EndsAt`` where it has a duration)."""
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
            current = active_faults(cluster)
            fault: dict[str, Any] = {"FaultId": self.ids.fault_id(), "Type": spec.type}
            if spec.instance_id is not None:
                fault["InstanceId"] = spec.instance_id
            if spec.duration_s is not None:
                fault["DurationSeconds"] = spec.duration_s
            if spec.latency_ms is not None:
                fault["LatencyMs"] = spec.latency_ms
            if spec.error_rate is not None:
                fault["ErrorRate"] = spec.error_rate
                fault["ErrorKind"] = spec.error_kind or DEFAULT_ERROR_KIND
            fault["InjectedAt"] = now.timestamp()
            if spec.duration_s is not None:
                fault["EndsAt"] = now.timestamp() + spec.duration_s
            node = None
            if node_fault:
                node = self._live_node(cluster, spec, current)
                detail = self._act_on_node(node, fault)
            elif spec.type in HEALTH_FAULTS:
                node = self._live_node(cluster, spec, current)
                detail = "its deep health checks fail while it is in force (StartClusterHealthCheck)"
            else:
                running = next((f for f in current if f["Type"] in S3_FAULTS), None)
                if running is not None:
                    raise ConflictException(
                        f"Fault {running['FaultId']} ({running['Type']}) is in force on cluster "
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
                description=f"Fault {fault['FaultId']} injected: {_describe(fault)}; {detail}.",
            )
            answer = {**fault, "PolicyGeneration": cluster.generation}
        self.on_change()
        return cluster, answer

    def _live_node(self, cluster: Cluster, spec: FaultSpec, current: list[dict[str, Any]]) -> Node:
        node = _node(cluster, spec.instance_id)
        if node is None or node.status == NodeStatus.SHUTTING_DOWN:
            raise ResourceNotFound(f"Node '{spec.instance_id}' does not exist in cluster '{cluster.name}'.")
        if node.status not in LIVE:
            raise ConflictException(
                f"Node {node.id} is {node.status}; node faults are injected into Pending or Running nodes."
            )
        held = next((f for f in current if f.get("InstanceId") == node.id), None)
        if held is not None:
            raise ConflictException(
                f"Fault {held['FaultId']} ({held['Type']}) is in force on node {node.id}; clear it or wait "
                "for it to end first."
            )
        return node

    def _act_on_node(self, node: Node, fault: dict[str, Any]) -> str:
        """Signal the node's agent (inside the transaction that records the fault: the reconciler,
        which holds the same lock, never sees the agent gone without the fault)."""
        kind = fault["Type"]
        if kind == "NetworkPartition":
            pids = self.provisioner.partition_agent(node, fault_id=fault["FaultId"], until=fault["EndsAt"])
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

    def list_faults(self, *, name: str) -> tuple[Cluster, list[dict[str, Any]]]:
        """The faults in force, oldest first (those past their end, not yet ended by the reconciler,
        are left out)."""
        epoch = self.clock.now().timestamp()
        with self.db.read() as session:
            cluster = self._cluster(session, name)
            found = [f for f in active_faults(cluster) if f.get("EndsAt") is None or f["EndsAt"] > epoch]
            return cluster, found

    def clear_fault(self, *, name: str, fault_id: str) -> tuple[Cluster, dict[str, Any]]:
        """End an S3 fault or a hang now. A NodeLoss cannot be undone: it ends when the node fails."""
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster(session, name, lock=True)
            end_due_faults(session, ids=self.ids, now=now, cluster=cluster, provisioner=self.provisioner)
            fault = next((f for f in active_faults(cluster) if f["FaultId"] == fault_id), None)
            if fault is None:
                raise ResourceNotFound(f"Fault '{fault_id}' is not in force in cluster '{cluster.name}'.")
            if fault["Type"] == "NodeLoss":
                raise ValidationException(
                    f"Fault {fault_id} (NodeLoss) cannot be cleared: the node's memory is gone. It ends when "
                    "the control plane has failed the node."
                )
            node = _node(cluster, fault.get("InstanceId"))
            if node is not None:
                _undo(self.provisioner, node, fault)
            _end(session, ids=self.ids, now=now, cluster=cluster, fault=fault, reason="cleared")
            answer = {**fault, "ClearedAt": now.timestamp(), "PolicyGeneration": cluster.generation}
        self.on_change()
        return cluster, answer

    # ------------------------------------------------------------------ the control plane's own

    def inject_control_plane_fault(self, *, duration_s: int) -> dict[str, Any]:
        """Start a DatabaseOutage of ``duration_s`` seconds now (its injection recorded in every
        cluster's events first, while the database still answers)."""
        running = self._outage_record()
        if running is not None:
            raise ConflictException(
                f"Fault {running['FaultId']} ({running['Type']}) is in force; one at a time: clear it first."
            )
        now = self.clock.now()
        fault_id = self.ids.fault_id()
        description = (
            f"Fault {fault_id} injected: DatabaseOutage (every database request fails, for "
            f"{duration_s} s); the control plane answers 503 ServiceUnavailable until it ends."
        )
        with self.db.write() as session:
            for cluster in session.scalars(select(Cluster)):
                events.record(
                    session, ids=self.ids, now=now, cluster=cluster, level=Level.WARN, description=description
                )
        outage = self.db.begin_outage(fault_id=fault_id, duration_s=duration_s)
        return _outage_wire(outage)

    def _outage_record(self) -> dict[str, Any] | None:
        outage = self.db.outage()
        return _outage_wire(outage) if outage is not None and outage.ended_at is None else None

    def list_control_plane_faults(self) -> list[dict[str, Any]]:
        """The control-plane faults in force (no database needed)."""
        record = self._outage_record()
        return [record] if record is not None else []

    def clear_control_plane_fault(self, *, fault_id: str) -> dict[str, Any]:
        """End a DatabaseOutage now; its end is recorded in every cluster's events."""
        current = self._outage_record()
        if current is None or current["FaultId"] != fault_id:
            raise ResourceNotFound(f"Fault '{fault_id}' is not in force in this control plane.")
        outage = self.db.end_outage(fault_id=fault_id)
        if outage is None:  # it ended by itself meanwhile, and was reported
            raise ResourceNotFound(f"Fault '{fault_id}' is not in force in this control plane.")
        _report_outage(db=self.db, clock=self.clock, ids=self.ids, outage=outage, reason="cleared")
        self.on_change()
        return {**_outage_wire(outage), "ClearedAt": outage.ended_at}


def report_ended_outage(*, db: Database, clock: Clock, ids: Ids) -> bool:
    """The reconciler's part: once a DatabaseOutage has run its time and the database answers
    again, record its end in every cluster's events and forget it. Whether one was reported."""
    outage = db.outage()
    if outage is None or outage.ended_at is None:
        return False
    _report_outage(db=db, clock=clock, ids=ids, outage=outage, reason=f"its {outage.duration_s:g} s passed")
    db.end_outage(fault_id=outage.fault_id)
    return True


def _report_outage(*, db: Database, clock: Clock, ids: Ids, outage: Outage, reason: str) -> None:
    now = clock.now()
    refused = "1 request" if outage.refused == 1 else f"{outage.refused} requests"
    description = (
        f"Fault {outage.fault_id} ended: DatabaseOutage (every database request fails, for "
        f"{outage.duration_s:g} s); {reason}. {refused} to the database failed meanwhile; "
        "reconciliation resumed."
    )
    with db.write() as session:
        for cluster in session.scalars(select(Cluster)):
            events.record(session, ids=ids, now=now, cluster=cluster, description=description)


def _outage_wire(outage: Outage) -> dict[str, Any]:
    return {
        "FaultId": outage.fault_id,
        "Type": "DatabaseOutage",
        "DurationSeconds": int(outage.duration_s),
        "InjectedAt": outage.started_at,
        "EndsAt": outage.started_at + outage.duration_s,
    }
