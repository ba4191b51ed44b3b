"""What the OpenAPI document holds for every operation alike: the error answers and the examples.

The routes declare what is theirs (hyperpod_sim/api/rest.py, extension_routes.py, agent_routes.py);
:func:`finish` then makes the document a contract for the answers every route shares. Each status
the service can answer is documented with the body it comes with: the AWS error shape
(``{"__type": "<Code>", "message": "..."}``) everywhere but under ``/agent/v1``, where the agent
protocol's own (``{"error": "<Code>", "message": "..."}``, docs/agent-protocol.md). FastAPI's 422
is not one of them: the app answers a body that fails a route's model 400 (hyperpod_sim/api/app.py).
Every request body, answer and path parameter gets an example: the route's own where it has one,
otherwise one built from the schema, with the member values below.
"""

from __future__ import annotations

import re
from typing import Any

from hyperpod_sim.api.gate import AGENT_PREFIX, OPEN_PATHS

AWS_ERROR = "AwsError"
AGENT_ERROR = "AgentError"
SCHEMAS: dict[str, dict[str, Any]] = {
    AWS_ERROR: {
        "type": "object",
        "description": "An AWS error, as botocore reads it: the error code and its message.",
        "properties": {
            "__type": {"type": "string", "description": "The error code, e.g. ResourceNotFound"},
            "message": {"type": "string"},
        },
        "required": ["__type", "message"],
        "additionalProperties": False,
    },
    AGENT_ERROR: {
        "type": "object",
        "description": "An agent protocol error (docs/agent-protocol.md).",
        "properties": {
            "error": {"type": "string", "description": "The error code, e.g. NodeNotFound"},
            "message": {"type": "string"},
        },
        "required": ["error", "message"],
        "additionalProperties": False,
    },
}

UNAUTHORIZED = (
    "With credentials configured (HPSIM_AUTH__CREDENTIALS): MissingAuthenticationToken, "
    "UnrecognizedClientException or InvalidSignatureException (docs/security.md)"
)
TOO_LARGE = "SerializationException: the body is over HPSIM_LIMITS__MAX_BODY_BYTES"
UNAVAILABLE = "ServiceUnavailable: the service's database is unavailable; retry later"
NO_ROUTE = "A path no route serves (e.g. a path parameter holding '/'): UnknownOperationException"

# status -> (description, example code, example message), of the answers every operation shares.
_AWS_SHARED: dict[str, tuple[str, str, str]] = {
    "400": (
        "ValidationException, SerializationException (a body that is not a JSON object, or nests "
        "too deep) and the other client errors",
        "ValidationException",
        "1 validation error detected: Value 'demo!' at 'clusterName' failed to satisfy constraint: "
        "Member must satisfy regular expression pattern: ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}",
    ),
    "401": (UNAUTHORIZED, "MissingAuthenticationToken", "Request is missing Authentication Token"),
    "403": (
        "MissingAuthenticationToken (credentials configured, none sent) or AccessDeniedException",
        "MissingAuthenticationToken",
        "Request is missing Authentication Token",
    ),
    "404": (NO_ROUTE, "ResourceNotFound", "Cluster 'demo' does not exist."),
    "413": (
        TOO_LARGE,
        "SerializationException",
        "The request body is 2000000 bytes, over the limit of 1048576 bytes (HPSIM_LIMITS__MAX_BODY_BYTES).",
    ),
    "503": (
        UNAVAILABLE,
        "ServiceUnavailable",
        "The service's database is unavailable; retry the request later.",
    ),
}
_AGENT_SHARED: dict[str, tuple[str, str, str]] = {
    "400": (
        "InvalidRequest: the body or a member is not what the route takes",
        "InvalidRequest",
        "body.endpoint: Field required",
    ),
    "401": (
        "MissingToken: no `Authorization: Bearer <token>`",
        "MissingToken",
        "Authorization: Bearer <node token> is required.",
    ),
    "403": (
        "InvalidToken: the token is not one of this cluster or node",
        "InvalidToken",
        "The token is not the node token of this node.",
    ),
    "404": (
        "NodeNotFound or NamespaceNotFound (a missing cluster answers as a wrong token: 401/403)",
        "NodeNotFound",
        "Node i-0123456789abcdef0 is not a node of cluster 'demo'.",
    ),
    "413": (
        TOO_LARGE,
        "InvalidRequest",
        "The request body is over the limit of 1048576 bytes (HPSIM_LIMITS__MAX_BODY_BYTES).",
    ),
    "503": (
        "ServiceUnavailable: the control plane's database is unavailable; the agent retries",
        "ServiceUnavailable",
        "the control plane's database is unavailable",
    ),
}
# What the service says with each code, for the examples of the answers that name it first.
MESSAGES = {
    "ResourceNotFound": "Cluster 'demo' does not exist.",
    "ResourceInUse": "Cluster with name 'demo' already exists.",
    "ConflictException": "Cluster 'demo' is Creating; wait until it is InService.",
    "AccessDeniedException": "The access key hpsim-user is not authorized to inject or clear faults.",
    "NoPendingSlot": "Every node slot of cluster 'demo' has an agent.",
    "NamespaceExists": "Namespace 'llama' already exists.",
}
_CODE = re.compile(r"\b([A-Z][a-z]+(?:[A-Z][a-z0-9]*)+)\b")

ARN = "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl"
_ARN_PREFIX = "arn:aws:sagemaker:us-east-1:123456789012"
# Member (or path parameter) name -> the value its examples show.
VALUES: dict[str, Any] = {
    "ClusterName": "demo",
    "ClusterArn": ARN,
    "ResourceArn": ARN,
    "ClusterStatus": "InService",
    "InstanceGroupName": "workers",
    "InstanceType": "ml.p5.48xlarge",
    "InstanceCount": 4,
    "CurrentCount": 4,
    "TargetCount": 4,
    "ExecutionRole": "arn:aws:iam::123456789012:role/HyperPodExecution",
    "InstanceId": "i-0123456789abcdef0",
    "NodeId": "i-0123456789abcdef0",
    "NodeLogicalId": "workers-0",
    "EventId": "2f6c0d1e-8b3a-4c5d-9e7f-0a1b2c3d4e5f",
    "FaultId": "f-3f2a9c41d07b5e68",
    "CreationTime": 1764460800.0,
    "LaunchTime": 1764460800.0,
    "EventTime": 1764460800.0,
    "Key": "team",
    "Value": "research",
    "name": "demo",
    "cluster": "demo",
    "node_id": "i-0123456789abcdef0",
    "node": "i-0123456789abcdef0",
    "job": "llama",
    "attempt": 2,
    "event_id": "2f6c0d1e-8b3a-4c5d-9e7f-0a1b2c3d4e5f",
    "fault_id": "f-3f2a9c41d07b5e68",
    "OperationId": "7d1e2c3b-4a5f-4e6d-8c7b-9a0f1e2d3c4b",
    "operation_id": "7d1e2c3b-4a5f-4e6d-8c7b-9a0f1e2d3c4b",
    "ClusterSchedulerConfigId": "a1b2c3d4e5f6",
    "config_id": "a1b2c3d4e5f6",
    "ExtensionName": "sagemaker-observability",
    "extension_name": "sagemaker-observability",
    "ExtensionArn": f"{_ARN_PREFIX}:extension/sagemaker-observability/demo/a1b2c3d4e5f6",
    "VolumeId": "vol-0123456789abcdef0",
    "NetworkInterfaceId": "eni-0123456789abcdef0",
    "ClusterSchedulerConfigArn": f"{_ARN_PREFIX}:cluster-scheduler-config/a1b2c3d4e5f6",
    "ExtensionVersion": "1.1.0",
    "AttachmentId": "eni-attach-0123456789abcdef0",
    "DeviceName": "/dev/sdf",
}


def _error_content(ref: str, code_key: str, code: str, message: str, media_type: str) -> dict[str, Any]:
    return {
        media_type: {
            "schema": {"$ref": f"#/components/schemas/{ref}"},
            "example": {code_key: code, "message": message},
        }
    }


def _document_errors(path: str, operation: dict[str, Any]) -> None:
    agent = path.startswith(AGENT_PREFIX)
    shared = _AGENT_SHARED if agent else _AWS_SHARED
    responses: dict[str, Any] = operation.setdefault("responses", {})
    responses.pop("422", None)
    wanted = ["400", "413", "503"]
    if agent:
        wanted += ["401", "403", "404"]
    elif path == "/":  # the AWS JSON entry answers with AWS's own statuses
        wanted.append("403")
    else:
        if path not in OPEN_PATHS:
            wanted.append("401")
        if "{" in path:
            wanted.append("404")
    for status in wanted:
        responses.setdefault(status, {"description": shared[status][0]})
    for status, response in responses.items():
        if int(status) < 400 or "content" in response:
            continue
        _, code, message = shared.get(status, ("", "", ""))
        named = _CODE.search(response.get("description", ""))
        if named is not None and named.group(1) != code:
            code = named.group(1)
            message = MESSAGES.get(code, response["description"])
        code = code or ("ConflictException" if status == "409" else "ValidationException")
        ref, key = (AGENT_ERROR, "error") if agent else (AWS_ERROR, "__type")
        media_type = "application/x-amz-json-1.1" if path == "/" else "application/json"
        response["content"] = _error_content(ref, key, code, message or response["description"], media_type)


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def example(schema: dict[str, Any], components: dict[str, Any], depth: int = 0, name: str = "") -> Any:
    """A value of ``schema``: the member values above where they fit, and otherwise the simplest
    value of the type (objects with their required members only)."""
    schema = _resolve(schema, components)
    if "example" in schema:
        return schema["example"]
    if schema.get("examples"):
        return schema["examples"][0]
    if name in VALUES and VALUES[name] in schema.get("enum", [VALUES[name]]):
        return VALUES[name]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            choices = [s for s in schema[key] if _resolve(s, components).get("type") != "null"]
            return example(choices[0], components, depth, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object":
        properties: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return {
            member: example(prop, components, depth + 1, member)
            for member, prop in properties.items()
            if member in required or (member in VALUES and depth < 4)
        }
    if kind == "array":
        count = schema.get("minItems", 1 if depth < 4 else 0)
        return [example(schema.get("items", {}), components, depth + 1, name) for _ in range(count)]
    if kind == "string":
        return "x" * max(1, schema.get("minLength", 1)) if "pattern" not in schema else "demo"
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        return low if kind == "integer" else float(low)
    if kind == "boolean":
        return True
    return {}


def _add_examples(operation: dict[str, Any], components: dict[str, Any]) -> None:
    bodies = [operation.get("requestBody", {}), *operation.get("responses", {}).values()]
    for body in bodies:
        for content in body.get("content", {}).values():
            if "example" not in content and "examples" not in content and "schema" in content:
                content["example"] = example(content["schema"], components)
    for parameter in operation.get("parameters", []):
        if "example" not in parameter and "examples" not in parameter:
            if parameter["name"] in VALUES:
                parameter["example"] = VALUES[parameter["name"]]
            elif parameter.get("required"):
                parameter["example"] = example(parameter.get("schema", {}), components)


def finish(document: dict[str, Any]) -> None:
    """Add the shared error answers, their schemas and the missing examples to ``document``."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(SCHEMAS)
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    for path, operations in document["paths"].items():
        for operation in operations.values():
            _document_errors(path, operation)
            _add_examples(operation, components)
