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

S3 faults act on every agent of the cluster: they travel in the node policy (``faults.s3``), so a
change bumps the policy generation and is pushed like any other; the agents apply them in their S3
client (agents/s3objects.py). One S3 fault at a time per cluster. ``S3Latency`` delays every
request, ``S3Errors`` answers a share of them 503 SlowDown (``Throttle``) or 500 InternalError,
``S3Outage`` fails them all. Without ``DurationSeconds`` they last until cleared.

Faults in force are stored with the cluster (its ``faults`` column), with their end time, so a
restarted control plane still ends them: the reconciler calls ``end_due_faults`` on every pass.
Each injection and each end is a cluster event.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from domain import events
from domain.clock import Clock, Ids
from domain.errors import ConflictException, ResourceNotFound, ValidationException, validation_error
from domain.events import Level
from domain.lifecycle import ClusterStatus, NodeStatus
from domain.provisioning import Provisioner
from models import Cluster, Database, Node

NODE_FAULTS = ("AgentCrash", "NodeLoss", "AgentHang")
S3_FAULTS = ("S3Latency", "S3Errors", "S3Outage")
FAULT_TYPES = (*NODE_FAULTS, *S3_FAULTS)
ERROR_KINDS = ("Throttle", "InternalError")
MEMBERS = ("Type", "InstanceId", "DurationSeconds", "LatencyMs", "ErrorRate", "ErrorKind")
MAX_DURATION_S = 86_400
MAX_LATENCY_MS = 60_000
# The members each type takes, and which of them it requires.
_TAKES: dict[str, tuple[str, ...]] = {
    "AgentCrash": ("InstanceId",),
    "NodeLoss": ("InstanceId",),
    "AgentHang": ("InstanceId", "DurationSeconds"),
    "S3Latency": ("LatencyMs", "DurationSeconds"),
    "S3Errors": ("ErrorRate", "ErrorKind", "DurationSeconds"),
    "S3Outage": ("DurationSeconds",),
}
_REQUIRES: dict[str, tuple[str, ...]] = {
    "AgentCrash": ("InstanceId",),
    "NodeLoss": ("InstanceId",),
    "AgentHang": ("InstanceId", "DurationSeconds"),
    "S3Latency": ("LatencyMs",),
    "S3Errors": ("ErrorRate",),
    "S3Outage": (),
}
# Cluster statuses in which faults are accepted: the cluster runs, whether or not a rollout is on.
ACCEPTING = (ClusterStatus.IN_SERVICE, ClusterStatus.UPDATING)
LIVE = (NodeStatus.PENDING, NodeStatus.RUNNING)


def _where(member: str) -> str:
    return member[0].lower() + member[1:]


@dataclass(frozen=True)
class FaultSpec:
    """A validated injection request."""

    type: str
    instance_id: str | None = None
    duration_s: int | None = None
    latency_ms: int | None = None
    error_rate: float | None = None
    error_kind: str | None = None


def parse_fault(body: object) -> FaultSpec:
    """Check an injection body; one ValidationException naming every bad member."""
    if not isinstance(body, dict):
        raise validation_error(["The fault must be a JSON object"])
    errors = [
        f"Unknown member '{key}': allowed members are {', '.join(MEMBERS)}"
        for key in body
        if key not in MEMBERS
    ]
    kind = body.get("Type")
    if kind is None:
        errors.append("Value null at 'type' failed to satisfy constraint: Member must not be null")
    elif kind not in FAULT_TYPES:
        errors.append(
            f"Value '{kind}' at 'type' failed to satisfy constraint: Member must satisfy enum value set: "
            f"[{', '.join(FAULT_TYPES)}]"
        )
    if errors or not isinstance(kind, str):
        raise validation_error(errors)
    for member in MEMBERS[1:]:
        if member in body and member not in _TAKES[kind]:
            takes = ", ".join(_TAKES[kind])
            errors.append(f"Member '{member}' does not apply to Type '{kind}', which takes {takes}")
    for member in _REQUIRES[kind]:
        if body.get(member) is None:
            errors.append(
                f"Value null at '{_where(member)}' failed to satisfy constraint: Member must not be null"
            )
    instance_id = body.get("InstanceId")
    if instance_id is not None and (not isinstance(instance_id, str) or not 1 <= len(instance_id) <= 19):
        errors.append(
            f"Value '{instance_id}' at 'instanceId' failed to satisfy constraint: Member must be a string "
            "of 1 to 19 characters"
        )
    duration = _integer(body, "DurationSeconds", errors, low=1, high=MAX_DURATION_S)
    latency = _integer(body, "LatencyMs", errors, low=1, high=MAX_LATENCY_MS)
    rate = body.get("ErrorRate")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
            errors.append(
                f"Value '{rate}' at 'errorRate' failed to satisfy constraint: Member must be a number"
            )
            rate = None
        elif not 0 < rate <= 1:
            errors.append(
                f"Value '{rate}' at 'errorRate' failed to satisfy constraint: Member must have value greater "
                "than 0 and less than or equal to 1"
            )
    error_kind = body.get("ErrorKind")
    if error_kind is not None and error_kind not in ERROR_KINDS:
        errors.append(
            f"Value '{error_kind}' at 'errorKind' failed to satisfy constraint: "
            f"Member must satisfy enum value set: [{', '.join(ERROR_KINDS)}]"
        )
    if errors:
        raise validation_error(errors)
    return FaultSpec(
        type=kind,
        instance_id=instance_id,
        duration_s=duration,
        latency_ms=latency,
        error_rate=float(rate) if rate is not None else None,
        error_kind=(error_kind or "Throttle") if kind == "S3Errors" else None,
    )


def _integer(body: dict[str, Any], member: str, errors: list[str], *, low: int, high: int) -> int | None:
    value = body.get(member)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(
            f"Value '{value}' at '{_where(member)}' failed to satisfy constraint: Member must be an integer"
        )
        return None
    if not low <= value <= high:
        errors.append(
            f"Value '{value}' at '{_where(member)}' failed to satisfy constraint: Member must have value "
            f"between {low} and {high}"
        )
    return value


# ---------------------------------------------------------------------- stored faults


def active_faults(cluster: Cluster) -> list[dict[str, Any]]:
    """The faults in force, in their wire shape (the ``faults`` column)."""
    return list(cluster.faults or [])


def lost_nodes(cluster: Cluster) -> set[str]:
    """Nodes with a NodeLoss in force: their agent is not to be restarted."""
    return {f["InstanceId"] for f in active_faults(cluster) if f["Type"] == "NodeLoss"}


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
    what = f"{kind} on node {fault['InstanceId']}" if kind in NODE_FAULTS else kind
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
        cluster.generation += 1
        description += f" Policy generation {cluster.generation}."
    events.record(session, ids=ids, now=now, cluster=cluster, node=node, description=description)


def _node(cluster: Cluster, node_id: str | None) -> Node | None:
    if node_id is None:
        return None
    return next((n for n in cluster.nodes if n.id == node_id), None)


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
        elif fault["Type"] == "AgentHang" and (node is None or node.status == NodeStatus.SHUTTING_DOWN):
            # A replaced or deleted node's agent was sent SIGTERM and SIGCONT by its provisioner.
            _end(session, ids=ids, now=now, cluster=cluster, fault=fault, reason="the node is shutting down")
        elif ends_at is not None and ends_at <= epoch:
            if fault["Type"] == "AgentHang" and node is not None:
                provisioner.resume_agent(node)
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
        column = Cluster.arn if name.startswith("arn:") else Cluster.name
        query = select(Cluster).where(column == name).options(selectinload(Cluster.nodes))
        if lock:
            query = query.with_for_update()
        cluster = session.scalars(query).one_or_none()
        if cluster is None:
            raise ResourceNotFound(f"Cluster '{name}' does not exist.")
        return cluster

    def inject_fault(self, *, name: str, body: object) -> tuple[Cluster, dict[str, Any]]:
        """Inject one fault now; its record (``FaultId``, ``Type``, the members given, ``InjectedAt``,
        ``EndsAt`` where it has a duration)."""
        spec = parse_fault(body)
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
                fault["ErrorKind"] = spec.error_kind
            fault["InjectedAt"] = now.timestamp()
            if spec.duration_s is not None:
                fault["EndsAt"] = now.timestamp() + spec.duration_s
            node = None
            if node_fault:
                node = self._live_node(cluster, spec, current)
                detail = self._act_on_node(node, spec.type)
            else:
                running = next((f for f in current if f["Type"] in S3_FAULTS), None)
                if running is not None:
                    raise ConflictException(
                        f"Fault {running['FaultId']} ({running['Type']}) is in force on cluster "
                        f"'{cluster.name}'; one S3 fault at a time: clear it first."
                    )
                cluster.generation += 1
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

    def _act_on_node(self, node: Node, kind: str) -> str:
        """Signal the node's agent (inside the transaction that records the fault: the reconciler,
        which holds the same lock, never sees the agent gone without the fault)."""
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
            if fault["Type"] == "AgentHang":
                node = _node(cluster, fault["InstanceId"])
                if node is not None:
                    self.provisioner.resume_agent(node)
            _end(session, ids=self.ids, now=now, cluster=cluster, fault=fault, reason="cleared")
            answer = {**fault, "ClearedAt": now.timestamp(), "PolicyGeneration": cluster.generation}
        self.on_change()
        return cluster, answer
