"""The REST routes of hyperpod-sim's own operations (the checkpoint policy, faults).

Each route is an operation of the extensions model (contracts/simulator_api.json): its method, path,
status, path parameters, body and answer schemas and its description all come from there, and a
request goes through hyperpod_sim/api/simulator_api.py's validation and handler. What is here is what a model
does not hold: the one-line summaries, the examples, the tags and which routes need the admin
credentials.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from hyperpod_sim.api import openapi_doc, shapes
from hyperpod_sim.api import simulator_api as extensions
from hyperpod_sim.api.deps import AdminDep, ServicesDep, parse_json
from hyperpod_sim.contracts import simulator_api as model
from hyperpod_sim.domain.errors import SerializationException

router = APIRouter()

CHECKPOINT_POLICY_EXAMPLE = {
    "S3BaseUri": "s3://my-checkpoints/llama",
    "PersistEverySteps": 100,
    "PersistEverySeconds": 1800,
    "S3Retention": 5,
    "InMemoryRetention": 3,
    "ReplicationFactor": 1,
    "AgentAccess": "Open",
}
FAULT_EXAMPLES: dict[str, dict[str, Any]] = {
    "AgentCrash": {
        "summary": "Kill a node's agent (it is restarted; its shared memory stays)",
        "value": {"Type": "AgentCrash", "InstanceId": "i-0123456789abcdef0"},
    },
    "NodeLoss": {
        "summary": "Lose a node: agent killed, shared memory wiped; the node fails and is replaced",
        "value": {"Type": "NodeLoss", "InstanceId": "i-0123456789abcdef0"},
    },
    "AgentHang": {
        "summary": "Stop a node's agent (SIGSTOP) for 30 s",
        "value": {"Type": "AgentHang", "InstanceId": "i-0123456789abcdef0", "DurationSeconds": 30},
    },
    "NetworkPartition": {
        "summary": "Cut a node off from the control plane for 20 s (trainers and peers still reach it)",
        "value": {"Type": "NetworkPartition", "InstanceId": "i-0123456789abcdef0", "DurationSeconds": 20},
    },
    "S3Latency": {
        "summary": "Delay every S3 request of the agents by 500 ms for 5 minutes",
        "value": {"Type": "S3Latency", "LatencyMs": 500, "DurationSeconds": 300},
    },
    "S3Errors": {
        "summary": "Answer 30 % of S3 requests 503 SlowDown until cleared",
        "value": {"Type": "S3Errors", "ErrorRate": 0.3, "ErrorKind": "Throttle"},
    },
    "S3Outage": {
        "summary": "Fail every S3 request for 60 s",
        "value": {"Type": "S3Outage", "DurationSeconds": 60},
    },
    "DeepHealthCheckFailure": {
        "summary": "Make a node fail its deep health checks (StartClusterHealthCheck) until cleared",
        "value": {"Type": "DeepHealthCheckFailure", "InstanceId": "i-0123456789abcdef0"},
    },
}
FAULT_ANSWER_EXAMPLE = {
    "ClusterName": "demo",
    "FaultId": "f-3f2a9c41d07b5e68",
    "Type": "S3Outage",
    "DurationSeconds": 60,
    "InjectedAt": 1764460800.0,
    "EndsAt": 1764460860.0,
    "PolicyGeneration": 5,
}
CONTROL_PLANE_FAULT_ANSWER = {
    "FaultId": "f-9b1c07e24a6d3f85",
    "Type": "DatabaseOutage",
    "DurationSeconds": 10,
    "InjectedAt": 1764460800.0,
    "EndsAt": 1764460810.0,
}
JOB_EXAMPLE: dict[str, Any] = {
    "JobId": "j-3f2a9c41d07b5e68",
    "JobName": "llama",
    "Status": "Running",
    "Command": ["python", "train.py"],
    "NodeCount": 2,
    "ProcessesPerNode": 1,
    "AutoResume": True,
    "MaxRestarts": 3,
    "Restarts": 1,
    "StopRequested": False,
    "LogPath": "/home/me/.local/state/hyperpod-sim/jobs/j-3f2a9c41d07b5e68.log",
    "CreatedAt": 1764460800.0,
    "Attempts": [
        {
            "Attempt": 1,
            "Nodes": ["i-0123456789abcdef0", "i-0fedcba9876543210"],
            "Status": "Failed",
            "StartedAt": 1764460801.0,
            "EndedAt": 1764460900.0,
            "ExitCode": 137,
            "Cause": "NodeFailure",
            "CauseNodeId": "i-0fedcba9876543210",
            "CauseRank": 1,
        },
        {
            "Attempt": 2,
            "Nodes": ["i-0123456789abcdef0", "i-0aaaabbbbccccdddd"],
            "Status": "Running",
            "StartedAt": 1764460930.0,
        },
    ],
}
_LISTED = {k: v for k, v in FAULT_ANSWER_EXAMPLE.items() if k not in ("ClusterName", "PolicyGeneration")}


@dataclass(frozen=True)
class ExtensionRoute:
    operation: str
    summary: str
    tag: str
    admin: bool = False
    examples: dict[str, Any] = field(default_factory=dict)
    """The request body's OpenAPI ``examples`` (or ``example``, one body)."""
    answer: dict[str, Any] | None = None


ROUTES = [
    ExtensionRoute(
        "GetCheckpointPolicy",
        "The cluster's checkpoint policy (hyperpod-sim extension)",
        "checkpointing",
        answer={
            "ClusterName": "demo",
            "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
            **CHECKPOINT_POLICY_EXAMPLE,
            "PolicyGeneration": 2,
        },
    ),
    ExtensionRoute(
        "PutCheckpointPolicy",
        "Replace the cluster's checkpoint policy (hyperpod-sim extension)",
        "checkpointing",
        examples={"example": CHECKPOINT_POLICY_EXAMPLE},
    ),
    ExtensionRoute(
        "InjectFault",
        "Inject a fault (hyperpod-sim extension)",
        "faults",
        admin=True,
        examples={"examples": FAULT_EXAMPLES},
        answer=FAULT_ANSWER_EXAMPLE,
    ),
    ExtensionRoute(
        "ListFaults",
        "The faults in force (hyperpod-sim extension)",
        "faults",
        answer={"ClusterName": "demo", "Faults": [_LISTED]},
    ),
    ExtensionRoute(
        "ClearFault",
        "End a fault now (hyperpod-sim extension)",
        "faults",
        admin=True,
        answer={**FAULT_ANSWER_EXAMPLE, "ClearedAt": 1764460830.0},
    ),
    ExtensionRoute(
        "InjectControlPlaneFault",
        "Make this control plane's database unreachable or silent (hyperpod-sim extension)",
        "faults",
        admin=True,
        examples={
            "examples": {
                "DatabaseOutage": {
                    "summary": "Every database request fails at once",
                    "value": {"Type": "DatabaseOutage", "DurationSeconds": 10},
                },
                "DatabaseHang": {
                    "summary": "Every database request waits for an answer that does not come",
                    "value": {"Type": "DatabaseHang", "DurationSeconds": 40},
                },
            }
        },
        answer=CONTROL_PLANE_FAULT_ANSWER,
    ),
    ExtensionRoute(
        "ListControlPlaneFaults",
        "This control plane's faults in force (hyperpod-sim extension)",
        "faults",
        answer={"Faults": [CONTROL_PLANE_FAULT_ANSWER]},
    ),
    ExtensionRoute(
        "ClearControlPlaneFault",
        "End this control plane's fault now (hyperpod-sim extension)",
        "faults",
        admin=True,
        answer={**CONTROL_PLANE_FAULT_ANSWER, "ClearedAt": 1764460805.0},
    ),
    ExtensionRoute(
        "CreateJob",
        "Record a training job on the cluster's nodes (hyperpod-sim extension)",
        "jobs",
        examples={
            "example": {
                "JobName": "llama",
                "Command": ["python", "train.py"],
                "NodeCount": 2,
                "ProcessesPerNode": 1,
                "AutoResume": True,
                "MaxRestarts": 3,
            }
        },
        answer={
            "ClusterName": "demo",
            "Job": {**JOB_EXAMPLE, "Status": "Pending", "Restarts": 0, "Attempts": []},
        },
    ),
    ExtensionRoute(
        "StartJobAttempt",
        "Place a job's next attempt on its nodes (hyperpod-sim extension)",
        "jobs",
        examples={"example": {"SupervisorPid": 4242, "SupervisorStartTime": 123456}},
        answer={
            "JobId": JOB_EXAMPLE["JobId"],
            "Attempt": 2,
            "Nodes": [
                {
                    "NodeId": "i-0123456789abcdef0",
                    "Address": "127.77.0.12",
                    "Environment": {
                        "HPSIM_NODE_ID": "i-0123456789abcdef0",
                        "HPSIM_JOB_ID": JOB_EXAMPLE["JobId"],
                    },
                }
            ],
        },
    ),
    ExtensionRoute(
        "EndJobAttempt",
        "Report how a job's attempt ended (hyperpod-sim extension)",
        "jobs",
        examples={
            "example": {"ExitCode": 137, "Cause": "NodeFailure", "NodeId": "i-0fedcba9876543210", "Rank": 1}
        },
        answer={"Job": {**JOB_EXAMPLE, "Status": "Pending"}, "Restart": True},
    ),
    ExtensionRoute(
        "StopJob",
        "Ask a job to stop (hyperpod-sim extension)",
        "jobs",
        answer={"Job": {**JOB_EXAMPLE, "StopRequested": True}},
    ),
    ExtensionRoute(
        "DescribeJob",
        "A job, its attempts and nodes (hyperpod-sim extension)",
        "jobs",
        answer={
            "ClusterName": "demo",
            "Job": {
                **JOB_EXAMPLE,
                "NodeStatuses": {"i-0123456789abcdef0": "Running", "i-0aaaabbbbccccdddd": "Running"},
            },
        },
    ),
    ExtensionRoute(
        "ListJobs",
        "The cluster's jobs (hyperpod-sim extension)",
        "jobs",
        answer={"ClusterName": "demo", "Jobs": [JOB_EXAMPLE]},
    ),
    ExtensionRoute(
        "StartNodeSession",
        "The environment of a command to run on a node (hyperpod-sim extension)",
        "nodes",
        answer={
            "ClusterName": "demo",
            "NodeId": "i-0123456789abcdef0",
            "Address": "127.77.0.12",
            "Environment": {
                "HPSIM_ON_NODE": "i-0123456789abcdef0",
                "HPSIM_NODE_ID": "i-0123456789abcdef0",
                "HPSIM_NODE_ADDRESS": "127.77.0.12",
                "HPSIM_AGENT_URL": "http://127.77.0.12:9200",
                "HPSIM_ENDPOINT_URL": "http://127.0.0.1:8080",
            },
        },
    ),
]

# ---------------------------------------------------------------------- OpenAPI from the model


def _operation(name: str) -> Any:
    return model.service_model().operation_model(name)


def _located(shape: Any) -> dict[str, Any]:
    """Path parameter -> member, of an input structure."""
    return {
        member.serialization.get("name", name): (name, member)
        for name, member in shape.members.items()
        if member.serialization.get("location") == "uri"
    }


def body_schema(shape: Any, components: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON Schema of a request body: the input structure's members that are not path
    parameters, inline (nested structures as ``$ref`` into ``components``)."""
    body = {n: m for n, m in shape.members.items() if "location" not in m.serialization}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {n: shapes.shape_to_json_schema(m, components) for n, m in body.items()},
    }
    required = [n for n in shape.required_members if n in body]
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def answer_schema(shape: Any, components: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """JSON Schema of an answer, inline; an optional member may be null (a checkpoint policy's
    unset members are)."""
    schema = body_schema(shape, components)
    for name, prop in schema["properties"].items():
        if name not in shape.required_members and isinstance(prop.get("type"), str):
            prop["type"] = [prop["type"], "null"]
    return schema


def _responses(
    route: ExtensionRoute, operation: Any, components: dict[str, dict[str, Any]]
) -> dict[Any, Any]:
    content: dict[str, Any] = {"schema": answer_schema(operation.output_shape, components)}
    if route.answer is not None:
        content["example"] = route.answer
    responses: dict[Any, Any] = {
        operation.http.get("responseCode", 200): {
            "description": f"{operation.name} output",
            "content": {"application/json": content},
        }
    }
    for error in operation.error_shapes:
        status = error.metadata["error"]["httpStatusCode"]  # as hyperpod_sim/api/rest.py's status_for answers
        text = f"{error.name}: {shapes.description(error.documentation)}"
        previous = responses.get(status)
        if previous:
            previous["description"] = f"{previous['description']}; {text}"
            continue
        # The error's wire body: its code and the model's message member.
        example = {"__type": error.name, "message": shapes.description(error.documentation)}
        schema = {"$ref": f"#/components/schemas/{openapi_doc.AWS_ERROR}"}
        responses[status] = {
            "description": text,
            "content": {"application/json": {"schema": schema, "example": example}},
        }
    return responses


def openapi_extra(route: ExtensionRoute, components: dict[str, dict[str, Any]]) -> dict[str, Any]:
    operation = _operation(route.operation)
    shape = operation.input_shape
    extra: dict[str, Any] = {
        "parameters": [
            {
                "name": parameter,
                "in": "path",
                "required": True,
                "schema": shapes.shape_to_json_schema(member, components),
                "description": shapes.description(member.documentation),
            }
            for parameter, (_, member) in _located(shape).items()
        ]
    }
    takes_body = any("location" not in m.serialization for m in shape.members.values())
    if operation.http["method"] in ("POST", "PUT") and takes_body:
        content = {"schema": body_schema(shape, components), **route.examples}
        extra["requestBody"] = {"required": True, "content": {"application/json": content}}
    return extra


# ---------------------------------------------------------------------- the routes


def _path_value(text: str, shape: Any) -> object:
    """A path parameter as its member's type: a number member's digits as an int (anything else
    stays text, and validation names it)."""
    if shape.type_name in ("integer", "long") and text.isdigit() and len(text) < 19:
        return int(text)
    return text


def _make_endpoint(route: ExtensionRoute) -> Callable[..., Any]:
    operation = _operation(route.operation)
    located = _located(operation.input_shape)
    has_body = operation.http["method"] in ("POST", "PUT")
    # An operation whose input is its path alone (StartNodeSession) may be sent without a body.
    bodiless = not any("location" not in m.serialization for m in operation.input_shape.members.values())

    async def endpoint(request: Request, services: ServicesDep) -> Any:
        body: Any = {}
        raw = await request.body() if has_body else b""
        if has_body and not (bodiless and not raw.strip()):
            body = parse_json(raw)
            if not isinstance(body, dict):
                raise SerializationException("The request body must be a JSON object.")
        path = {
            member: _path_value(request.path_params[parameter], shape)
            for parameter, (member, shape) in located.items()
        }
        return await run_in_threadpool(extensions.dispatch, services, route.operation, body, located=path)

    endpoint.__name__ = route.operation
    return endpoint


COMPONENTS: dict[str, dict[str, Any]] = {}
"""Structures the routes' schemas refer to (hyperpod_sim/api/openapi.py adds them to the OpenAPI document)."""

for _route in ROUTES:
    _model_operation = _operation(_route.operation)
    router.add_api_route(
        _model_operation.http["requestUri"],
        _make_endpoint(_route),
        methods=[_model_operation.http["method"]],
        status_code=_model_operation.http.get("responseCode", 200),
        response_model=None,  # the answer's schema is the model's (responses below)
        summary=_route.summary,
        description=shapes.description(_model_operation.documentation, limit=None),
        operation_id=_route.operation,
        tags=[_route.tag],
        dependencies=[AdminDep] if _route.admin else [],
        openapi_extra=openapi_extra(_route, COMPONENTS),
        responses=_responses(_route, _model_operation, COMPONENTS),
    )
