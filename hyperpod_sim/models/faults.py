"""Injected faults as values: a cluster's faults in force (its ``faults`` column) and the control
plane's own, in the shapes of the extensions model (hyperpod_sim/contracts/simulator_api.json:
``Fault``, ``ControlPlaneFault`` and their ``Clear...Response``). What they do is
hyperpod_sim/domain/faults.py's business.

The fields are declared in the order the members were always stored and answered in, so that the
stored JSON and the answers read as they did before the values existed.
"""

from __future__ import annotations

from typing import Literal

from hyperpod_sim.models.values import WireValue

# The model's FaultType enum, in its order, split by what a fault acts on.
NodeFaultType = Literal["AgentCrash", "NodeLoss", "AgentHang", "NetworkPartition"]
S3FaultType = Literal["S3Latency", "S3Errors", "S3Outage"]
HealthFaultType = Literal["DeepHealthCheckFailure"]
FaultType = Literal[NodeFaultType, S3FaultType, HealthFaultType]
ErrorKind = Literal["Throttle", "InternalError"]


class Fault(WireValue):
    """A fault in force on a cluster: the members it was injected with, and its times (epoch seconds)."""

    fault_id: str
    type: FaultType
    instance_id: str | None = None  # node and health faults
    duration_seconds: int | None = None  # None: until cleared, or until its node is dealt with
    latency_ms: int | None = None  # S3Latency
    error_rate: float | None = None  # S3Errors, with its error_kind
    error_kind: ErrorKind | None = None
    injected_at: float
    ends_at: float | None = None  # injected_at + duration_seconds


class ClearedFault(Fault):
    """The ClearFault answer's fault: as it was in force, and when it was cleared."""

    cleared_at: float


class ControlPlaneFault(WireValue):
    """A DatabaseOutage or DatabaseHang in force (held in this process only, models/db.py's ``Outage``)."""

    fault_id: str
    type: str  # models/db.py's OUTAGE or HANG
    duration_seconds: int
    injected_at: float
    ends_at: float


class ClearedControlPlaneFault(ControlPlaneFault):
    """The ClearControlPlaneFault answer: the fault as it was in force, and when it was cleared."""

    cleared_at: float
