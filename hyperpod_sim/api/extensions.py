"""hyperpod-sim's own operations: validated against their model, run, answered.

The model (hyperpod_sim/contracts/extensions.json, botocore's service-model format) declares each operation's
input and output; this module checks a request against it with the validator the AWS operations
use (hyperpod_sim/api/shapes.py), so the ValidationException messages read the same, calls the domain with
typed arguments and shapes its answer. An input with a per-type shape (``InjectFault``'s
``<Type>InjectFaultRequest``) is checked against the shape of the ``Type`` given: a member of the
operation that this type does not take is named first, as not applying to it.

The REST routes (hyperpod_sim/api/extension_routes.py) call :func:`dispatch`; so can a test, without HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hyperpod_sim.api import shapes
from hyperpod_sim.contracts import extensions
from hyperpod_sim.domain.checkpoint_policy import CheckpointPolicy
from hyperpod_sim.domain.clusters import ClusterService
from hyperpod_sim.domain.errors import UnknownOperationException, validation_error
from hyperpod_sim.domain.faults import FaultService, FaultSpec
from hyperpod_sim.models import Cluster

Params = dict[str, Any]


class ExtensionServices(Protocol):
    """What the extension operations need of the control plane's services (hyperpod_sim/api/deps.Services)."""

    @property
    def clusters(self) -> ClusterService: ...

    @property
    def faults(self) -> FaultService: ...


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
        **policy.to_wire(),
        "PolicyGeneration": cluster.generation,
    }


def get_checkpoint_policy(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return _policy_answer(*svc.clusters.checkpoint_policy(name=p["ClusterName"]))


def put_checkpoint_policy(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    policy = CheckpointPolicy.from_wire(p)
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
    return {"ClusterName": cluster.name, **fault}


def list_faults(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, found = svc.faults.list_faults(name=p["ClusterName"])
    return {"ClusterName": cluster.name, "Faults": found}


def clear_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    cluster, fault = svc.faults.clear_fault(name=p["ClusterName"], fault_id=p["FaultId"])
    return {"ClusterName": cluster.name, **fault}


def inject_control_plane_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return svc.faults.inject_control_plane_fault(duration_s=p["DurationSeconds"])


def list_control_plane_faults(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return {"Faults": svc.faults.list_control_plane_faults()}


def clear_control_plane_fault(svc: ExtensionServices, p: Params) -> dict[str, Any]:
    return svc.faults.clear_control_plane_fault(fault_id=p["FaultId"])


OPERATIONS: dict[str, Handler] = {
    "GetCheckpointPolicy": get_checkpoint_policy,
    "PutCheckpointPolicy": put_checkpoint_policy,
    "InjectFault": inject_fault,
    "ListFaults": list_faults,
    "ClearFault": clear_fault,
    "InjectControlPlaneFault": inject_control_plane_fault,
    "ListControlPlaneFaults": list_control_plane_faults,
    "ClearControlPlaneFault": clear_control_plane_fault,
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
