"""The extensions model (contracts/simulator_api.json) is what the API enforces, documents and the CLI
offers: a walk over every constraint of every extension operation's input (and each per-type
shape) breaks it and expects the validator's message; the OpenAPI document and the CLI's choices
are compared with the model."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from fastapi import FastAPI

from hyperpod_sim.api import simulator_api as extensions
from hyperpod_sim.api import simulator_routes as extension_routes
from hyperpod_sim.api.openapi import install_openapi
from hyperpod_sim.api.rest import status_for
from hyperpod_sim.cli import clusters as cluster_cli
from hyperpod_sim.contracts import simulator_api as model
from hyperpod_sim.domain import errors
from hyperpod_sim.domain.errors import SerializationException, ValidationException

EXAMPLES = {
    "S3BaseUri": "s3://bucket/prefix",
    "JobName": "train",
    "JobRef": "train",
    "NodeId": "i-0123456789abcdef0",
}
"""Valid values of the pattern-constrained shapes."""
BREAKERS = {"S3BaseUri": "http://bucket/prefix", "JobName": "-train", "NodeId": "node-1"}


def _minimal(shape: Any) -> Any:
    meta = shape.metadata
    if shape.type_name == "string":
        if getattr(shape, "enum", None):
            return shape.enum[0]
        return EXAMPLES.get(shape.name, "a" * max(meta.get("min", 1), 1))
    if shape.type_name in ("integer", "long"):
        return meta.get("min", 1)
    if shape.type_name == "double":
        return (meta.get("min", 0) + meta.get("max", 1)) / 2
    if shape.type_name == "list":
        return [_minimal(shape.member)] * max(meta.get("min", 1), 1)
    if shape.type_name == "boolean":
        return False
    raise AssertionError(f"no minimal value for {shape.name} ({shape.type_name})")


def _inputs() -> list[tuple[str, Any]]:
    """(operation, input shape): each operation's input, or each of its per-type shapes."""
    found = []
    for operation in model.service_model().operation_names:
        shape = extensions.input_shape(operation)
        kinds = shape.members[model.DISCRIMINATOR].enum if model.DISCRIMINATOR in shape.members else []
        variants = [model.variant(shape, kind) for kind in kinds]
        found += [(operation, v) for v in variants if v is not None] or [(operation, shape)]
    return found


def _cases() -> list[Any]:
    cases = []
    for operation, shape in _inputs():
        for name, member in shape.members.items():
            if "location" in member.serialization:
                continue
            meta = member.metadata
            for kind in ("min", "max", "pattern", "enum"):
                present = bool(getattr(member, "enum", None)) if kind == "enum" else kind in meta
                if present:
                    cases.append(pytest.param(operation, shape, name, kind, id=f"{shape.name}.{name}.{kind}"))
    return cases


def _request(shape: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body, located = {}, {}
    for name, member in shape.members.items():
        if name in shape.required_members:
            target = located if "location" in member.serialization else body
            target[name] = _minimal(member)
    if shape.name.endswith("InjectFaultRequest") and shape.name != "InjectFaultRequest":  # a per-type shape
        body[model.DISCRIMINATOR] = shape.name.removesuffix("InjectFaultRequest")
    return body, located


@pytest.mark.parametrize(("operation", "shape", "name", "kind"), _cases())
def test_every_constraint_is_enforced(operation: str, shape: Any, name: str, kind: str) -> None:
    body, located = _request(shape)
    assert extensions.validate(operation, body, located=located) is not None  # minimal is valid
    member = shape.members[name]
    meta = member.metadata
    if kind == "enum":
        bad: Any = "NotAValue"
        phrase = "must satisfy enum value set: [" + ", ".join(member.enum) + "]"
    elif kind == "pattern":
        bad = BREAKERS[member.name]
        phrase = f"must satisfy regular expression pattern: {meta['pattern']}"
    elif member.type_name in ("string", "list"):
        length = meta[kind] + (1 if kind == "max" else -1)
        bad = "a" * length if member.type_name == "string" else [_minimal(member.member)] * length
        relation = "less than or equal to" if kind == "max" else "greater than or equal to"
        phrase = f"must have length {relation} {meta[kind]}"
    else:
        bad = meta[kind] + (1 if kind == "max" else -1)
        relation = "less than or equal to" if kind == "max" else "greater than or equal to"
        phrase = f"must have value {relation} {meta[kind]}"
    with pytest.raises(ValidationException) as refused:
        extensions.validate(operation, {**body, name: bad}, located=located)
    assert f"at '{name[0].lower() + name[1:]}' failed to satisfy constraint: Member {phrase}" in (
        refused.value.message
    )


def test_required_members_and_json_types() -> None:
    with pytest.raises(ValidationException) as refused:
        extensions.validate("InjectControlPlaneFault", {}, located={})
    assert refused.value.message == (
        "2 validation errors detected: Value null at 'type' failed to satisfy constraint: Member must not "
        "be null; Value null at 'durationSeconds' failed to satisfy constraint: Member must not be null"
    )
    with pytest.raises(SerializationException) as wrong:
        extensions.validate("PutCheckpointPolicy", {"PersistEverySteps": "10"}, located={"ClusterName": "c"})
    assert (
        wrong.value.message == "Unexpected value type for 'persistEverySteps': expected integer, got string"
    )
    # A path parameter is not a body member.
    with pytest.raises(ValidationException, match="Unknown member 'ClusterName' at 'input'"):
        extensions.validate("PutCheckpointPolicy", {"ClusterName": "x"}, located={"ClusterName": "c"})


def test_every_operation_has_a_route_and_a_handler() -> None:
    operations = set(model.service_model().operation_names)
    assert {route.operation for route in extension_routes.ROUTES} == operations
    assert set(extensions.OPERATIONS) == operations


def test_the_openapi_schemas_are_the_models() -> None:
    app = FastAPI()
    app.include_router(extension_routes.router)
    install_openapi(app)
    paths = app.openapi()["paths"]
    for operation in model.service_model().operation_names:
        http = model.service_model().operation_model(operation).http
        documented = paths[http["requestUri"]][http["method"].lower()]
        assert documented["operationId"] == operation
        assert str(http["responseCode"]) in documented["responses"]
    body = paths["/clusters/{name}/checkpoint-policy"]["put"]["requestBody"]["content"]["application/json"]
    properties = body["schema"]["properties"]
    assert list(properties) == list(model.members("PutCheckpointPolicyRequest"))
    assert (properties["ReplicationFactor"]["minimum"], properties["ReplicationFactor"]["maximum"]) == (0, 3)
    assert properties["AgentAccess"]["enum"] == list(model.enum("AgentAccess"))
    answer = paths["/clusters/{name}/checkpoint-policy"]["get"]["responses"]["200"]["content"]
    assert answer["application/json"]["schema"]["properties"]["S3BaseUri"]["type"] == ["string", "null"]
    outage = paths["/faults"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert outage["properties"]["DurationSeconds"]["maximum"] == model.limits("OutageSeconds")[1]


def _choices(parser: argparse.ArgumentParser, *path: str) -> dict[str, Any]:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return {a.dest: a.choices for a in parser._actions if a.choices is not None}


def test_the_cli_offers_the_models_choices() -> None:
    parser = argparse.ArgumentParser()
    cluster_cli.add_parsers(parser.add_subparsers())
    choices = _choices(parser, "fault", "inject")
    assert tuple(choices["type"]) == model.enum("FaultType")
    assert tuple(choices["error_kind"]) == model.enum("ErrorKind")
    assert model.members("PutCheckpointPolicyRequest") == cluster_cli.POLICY_MEMBERS


def test_the_error_statuses_are_the_routes() -> None:
    for operation in model.service_model().operation_names:
        for error in model.service_model().operation_model(operation).error_shapes:
            raised = getattr(errors, error.name)("x")
            assert status_for(raised) == error.metadata["error"]["httpStatusCode"], error.name
