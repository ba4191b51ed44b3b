"""hyperpod-sim's own operations: validated against their model, run, answered.

The model (contracts/simulator_api.json, botocore's service-model format) declares each operation's
input and output; this module checks a request against it with the validator the AWS operations
use (hyperpod_sim/api/shapes.py), so the ValidationException messages read the same, calls the domain with
typed arguments and shapes its answer. An input with a per-type shape (``InjectFault``'s
``<Type>InjectFaultRequest``) is checked against the shape of the ``Type`` given: a member of the
operation that this type does not take is named first, as not applying to it.

The REST routes (hyperpod_sim/api/simulator_routes.py) call :func:`dispatch`; so can a test, without HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hyperpod_sim.api import shapes
from hyperpod_sim.contracts import simulator_api as extensions
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy
from hyperpod_sim.domain.clusters.service import ClusterService
from hyperpod_sim.domain.errors import UnknownOperationException, validation_error
from hyperpod_sim.domain.faults import FaultService, FaultSpec
from hyperpod_sim.domain.jobs import AttemptEnd, EndCause, JobService, JobSpec
from hyperpod_sim.domain.nodes.sessions import NodeSessionService
from hyperpod_sim.models import Cluster, Job

Params = dict[str, Any]


class ExtensionServices(Protocol):
    """What the extension operations need of the control plane's services (hyperpod_sim/api/deps.Services)."""

    @property
    def clusters(self) -> ClusterService: ...

    @property
    def faults(self) -> FaultService: ...

    @property
    def node_sessions(self) -> NodeSessionService: ...

    @property
    def jobs(self) -> JobService: ...


Handler = Callable[[ExtensionServices, Params], dict[str, Any]]


def input_shape(operation: str) -> Any:
    """The operation's input structure (botocore shape)."""
    return extensions.service_model().operation_model(operation).input_shape


def validate(operation: str, body: object, *, located: Mapping[str, object]) -> Params:
    """Check a request (``body`` the JSON body, ``located`` the path parameters by member name)
    against the operation's input shape; one ValidationException naming every bad member."""
    shape = input_shape(operation)
    errors: list[str] = []
    if isinstance(body, dict):
        kind = body.get(extensions.DISCRIMINATOR)
        variant = extensions.variant(shape, kind)
        if variant is not None:
            takes = [
                name
                for name, member in variant.members.items()
                if name != extensions.DISCRIMINATOR and "location" not in member.serialization
            ]
            foreign = [key for key in body if key in shape.members and key not in variant.members]
            errors += [
                f"Member '{key}' does not apply to Type '{kind}', which takes {', '.join(takes)}"
                for key in foreign
            ]
            body = {key: value for key, value in body.items() if key not in foreign}
            shape = variant
    params, found = shapes.collect_input(shape, body, located=located)
    errors += found
    if errors:
        raise validation_error(errors)
    return params


# ---------------------------------------------------------------------- handlers


def _policy_answer(cluster: Cluster, policy: CheckpointPolicy) -> dict[str, Any]:
    return {
        "ClusterName": cluster.name,
        "ClusterArn": cluster.arn,
        **policy.wire(),
        "PolicyGeneration": cluster.generation,
    }


def get_checkpoint_policy(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return _policy_answer(*svc.clusters.checkpoint_policy(name=p["ClusterName"]))


def put_checkpoint_policy(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    # An absent or null member takes its default.
    policy = CheckpointPolicy.from_wire({key: value for key, value in p.items() if value is not None})
    return _policy_answer(*svc.clusters.put_checkpoint_policy(name=p["ClusterName"], policy=policy))


def inject_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    rate = p.get("ErrorRate")
    spec = FaultSpec(
        type=p["Type"],
        instance_id=p.get("InstanceId"),
        duration_s=p.get("DurationSeconds"),
        latency_ms=p.get("LatencyMs"),
        error_rate=float(rate) if rate is not None else None,
        error_kind=p.get("ErrorKind"),
    )
    cluster, fault = svc.faults.inject_fault(name=p["ClusterName"], spec=spec)
    return {"ClusterName": cluster.name, **fault.wire(), "PolicyGeneration": cluster.generation}


def list_faults(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, found = svc.faults.list_faults(name=p["ClusterName"])
    return {"ClusterName": cluster.name, "Faults": [fault.wire() for fault in found]}


def clear_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, fault = svc.faults.clear_fault(name=p["ClusterName"], fault_id=p["FaultId"])
    return {"ClusterName": cluster.name, **fault.wire(), "PolicyGeneration": cluster.generation}


def inject_control_plane_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return svc.faults.inject_control_plane_fault(duration_s=p["DurationSeconds"], kind=p["Type"]).wire()


def list_control_plane_faults(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return {"Faults": [fault.wire() for fault in svc.faults.list_control_plane_faults()]}


def clear_control_plane_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return svc.faults.clear_control_plane_fault(fault_id=p["FaultId"]).wire()


def start_node_session(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    opened = svc.node_sessions.open_session(name=p["ClusterName"], node_id=p["NodeId"])
    return {
        "ClusterName": opened.cluster,
        "NodeId": opened.node_id,
        "Address": opened.address,
        "Environment": opened.environment,
    }


def job_wire(job: Job, node_statuses: dict[str, str] | None = None) -> dict[str, Any]:
    """A job as DescribeJob answers it."""
    wire: dict[str, Any] = {
        "JobId": job.id,
        "JobName": job.name,
        "Status": job.status,
        "StatusMessage": job.status_message,
        "Command": list(job.command),
        "NodeCount": job.node_count,
        "ProcessesPerNode": job.procs_per_node,
        "AutoResume": job.auto_resume,
        "MaxRestarts": job.max_restarts,
        "Restarts": job.restarts,
        "ExitCode": job.exit_code,
        "StopRequested": job.stop_requested,
        "LogPath": job.log_path,
        "CreatedAt": job.created_at.timestamp(),
        "EndedAt": job.ended_at.timestamp() if job.ended_at is not None else None,
        "Attempts": [
            {
                "Attempt": a.number,
                "Nodes": list(a.nodes),
                "Status": a.status,
                "StartedAt": a.started_at.timestamp(),
                "EndedAt": a.ended_at.timestamp() if a.ended_at is not None else None,
                "ExitCode": a.exit_code,
                "Cause": a.cause,
                "CauseNodeId": a.cause_node,
                "CauseRank": a.cause_rank,
            }
            for a in job.attempts
        ],
    }
    if node_statuses is not None:
        wire["NodeStatuses"] = node_statuses
    return wire


def create_job(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    spec = JobSpec(
        name=p.get("JobName"),
        command=list(p["Command"]),
        node_count=p.get("NodeCount"),
        procs_per_node=p.get("ProcessesPerNode") or 1,
        auto_resume=bool(p.get("AutoResume")),
        max_restarts=3 if p.get("MaxRestarts") is None else p["MaxRestarts"],
    )
    cluster, job = svc.jobs.create_job(name=p["ClusterName"], spec=spec, log_path=p.get("LogPath"))
    return {"ClusterName": cluster.name, "Job": job_wire(job)}


def start_job_attempt(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    placed = svc.jobs.start_attempt(
        name=p["ClusterName"],
        job=p["Job"],
        supervisor_pid=p["SupervisorPid"],
        supervisor_start_time=p["SupervisorStartTime"],
    )
    return {
        "JobId": placed.job.id,
        "Attempt": placed.attempt,
        "Nodes": [
            {"NodeId": n.node_id, "Address": n.address, "Environment": n.environment} for n in placed.nodes
        ],
    }


def end_job_attempt(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    end = AttemptEnd(
        exit_code=p["ExitCode"], cause=EndCause(p["Cause"]), node_id=p.get("NodeId"), rank=p.get("Rank")
    )
    job, restart = svc.jobs.end_attempt(name=p["ClusterName"], job=p["Job"], attempt=p["Attempt"], end=end)
    return {"Job": job_wire(job), "Restart": restart}


def stop_job(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return {"Job": job_wire(svc.jobs.stop_job(name=p["ClusterName"], job=p["Job"]))}


def describe_job(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, job, statuses = svc.jobs.describe_job(name=p["ClusterName"], job=p["Job"])
    return {"ClusterName": cluster.name, "Job": job_wire(job, statuses)}


def list_jobs(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, jobs = svc.jobs.list_jobs(name=p["ClusterName"])
    return {"ClusterName": cluster.name, "Jobs": [job_wire(job) for job in jobs]}


OPERATIONS: dict[str, Handler] = {
    "GetCheckpointPolicy": get_checkpoint_policy,
    "PutCheckpointPolicy": put_checkpoint_policy,
    "InjectFault": inject_fault,
    "ListFaults": list_faults,
    "ClearFault": clear_fault,
    "InjectControlPlaneFault": inject_control_plane_fault,
    "ListControlPlaneFaults": list_control_plane_faults,
    "ClearControlPlaneFault": clear_control_plane_fault,
    "StartNodeSession": start_node_session,
    "CreateJob": create_job,
    "StartJobAttempt": start_job_attempt,
    "EndJobAttempt": end_job_attempt,
    "StopJob": stop_job,
    "DescribeJob": describe_job,
    "ListJobs": list_jobs,
}


def dispatch(
    services: ExtensionServices, operation: str, body: object, *, located: Mapping[str, object]
) -> dict[str, Any]:
    """Validate a request of an extension operation, run it, answer it (members of its output
    shape; unset optional ones of a checkpoint policy as null)."""
    handler = OPERATIONS.get(operation)
    if handler is None:
        raise UnknownOperationException(f"Operation {operation} is not a hyperpod-sim extension.")
    return handler(services, validate(operation, body, located=located))
