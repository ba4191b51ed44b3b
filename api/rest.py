"""REST routes over the same operations as the AWS JSON entry.

Each route names one AWS operation; its path parameters, query parameters and JSON body are merged
into that operation's input (AWS member names), which then goes through the same validation,
domain call and output shaping as ``POST /``. The OpenAPI schema of every body and response is
generated from botocore's service model, the same source the validation uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi

from api import shapes
from api.deps import AdminDep, ServicesDep, as_aws_error, parse_json
from api.gate import AGENT_PREFIX, OPEN_PATHS
from api.operations import OPERATIONS, dispatch
from domain.errors import (
    AwsError,
    ConflictException,
    ResourceInUse,
    ResourceNotFound,
    SerializationException,
    validation_error,
)
from domain.faults import CONTROL_PLANE_FAULTS, FAULT_TYPES, MAX_OUTAGE_S

router = APIRouter(tags=["clusters"])

# REST keeps AWS's error codes and bodies; statuses follow HTTP where one fits better.
_REST_STATUS: dict[type[AwsError], int] = {
    ResourceNotFound: 404,
    ResourceInUse: 409,
    ConflictException: 409,
}


async def json_body(request: Request) -> Any:
    """The request's JSON body (``{}`` when empty); SerializationException when it is not JSON."""
    return parse_json(await request.body())


_INTEGER = re.compile(r"-?[0-9]{1,18}")


def _integer(key: str, value: str) -> int:
    """A query parameter of an integer member: ASCII digits with an optional minus sign, within
    int64 (18 digits); anything else is a ValidationException naming it."""
    if _INTEGER.fullmatch(value) is None:
        raise validation_error(
            [
                f"Value '{shapes.render(value)}' at '{shapes.camel(key)}' failed to satisfy constraint: "
                "Member must be an integer (ASCII digits, at most 18)"
            ]
        )
    return int(value)


def status_for(error: AwsError) -> int:
    return _REST_STATUS.get(type(error), error.status)


EXAMPLE_CREATE = {
    "ClusterName": "demo",
    "InstanceGroups": [
        {
            "InstanceGroupName": "workers",
            "InstanceType": "ml.p5.48xlarge",
            "InstanceCount": 4,
            "ExecutionRole": "arn:aws:iam::123456789012:role/HyperPodExecution",
            "LifeCycleConfig": {"SourceS3Uri": "s3://my-bucket/lifecycle/", "OnCreate": "on_create.sh"},
        }
    ],
    "Orchestrator": {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/my-eks"}},
    "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
    "NodeRecovery": "Automatic",
}
EXAMPLE_UPDATE = {
    "InstanceGroups": [
        {
            "InstanceGroupName": "workers",
            "InstanceType": "ml.p5.48xlarge",
            "InstanceCount": 8,
            "ExecutionRole": "arn:aws:iam::123456789012:role/HyperPodExecution",
        }
    ],
    "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 40},
}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    operation: str
    summary: str
    # Path parameter -> input member.
    path_members: dict[str, str] = field(default_factory=dict)
    body: bool = False
    query: bool = False
    example: dict[str, Any] | None = None


ROUTES = [
    Route("POST", "/clusters", "CreateCluster", "Create a cluster", body=True, example=EXAMPLE_CREATE),
    Route("GET", "/clusters", "ListClusters", "List clusters", query=True),
    Route("GET", "/clusters/{name}", "DescribeCluster", "Describe a cluster", {"name": "ClusterName"}),
    Route(
        "PATCH",
        "/clusters/{name}",
        "UpdateCluster",
        "Update a cluster (scale groups, delete groups, TieredStorageConfig, NodeRecovery)",
        {"name": "ClusterName"},
        body=True,
        example=EXAMPLE_UPDATE,
    ),
    Route("DELETE", "/clusters/{name}", "DeleteCluster", "Delete a cluster", {"name": "ClusterName"}),
    Route(
        "GET",
        "/clusters/{name}/nodes",
        "ListClusterNodes",
        "List a cluster's nodes",
        {"name": "ClusterName"},
        query=True,
    ),
    Route(
        "GET",
        "/clusters/{name}/nodes/{node_id}",
        "DescribeClusterNode",
        "Describe one node",
        {"name": "ClusterName", "node_id": "NodeId"},
    ),
    Route(
        "POST",
        "/clusters/{name}/nodes/batch-delete",
        "BatchDeleteClusterNodes",
        "Delete nodes by id or logical id",
        {"name": "ClusterName"},
        body=True,
        example={"NodeIds": ["i-0123456789abcdef0"]},
    ),
    Route(
        "GET",
        "/clusters/{name}/events",
        "ListClusterEvents",
        "List a cluster's events (node failures, replacements, policy rollouts), newest first",
        {"name": "ClusterName"},
        query=True,
    ),
    Route(
        "GET",
        "/clusters/{name}/events/{event_id}",
        "DescribeClusterEvent",
        "Describe one event",
        {"name": "ClusterName", "event_id": "EventId"},
    ),
    Route(
        "GET",
        "/tags",
        "ListTags",
        "List the tags of a cluster ARN",
        query=True,
    ),
    Route(
        "POST",
        "/tags",
        "AddTags",
        "Add or overwrite tags on a cluster ARN",
        body=True,
        example={
            "ResourceArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
            "Tags": [{"Key": "team", "Value": "research"}],
        },
    ),
    Route(
        "POST",
        "/tags/delete",
        "DeleteTags",
        "Remove tags from a cluster ARN",
        body=True,
        example={
            "ResourceArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
            "TagKeys": ["team"],
        },
    ),
]


def _query_params(operation: str, request: Request) -> dict[str, Any]:
    """Query string -> input members, typed by the input shape (lists repeat the parameter)."""
    shape = shapes.service_model().operation_model(operation).input_shape
    params: dict[str, Any] = {}
    for key in request.query_params:
        member = shape.members.get(key)
        values = request.query_params.getlist(key)
        if member is None:
            params[key] = values[-1]  # validation reports the unknown member
        elif member.type_name == "list":
            params[key] = values
        elif member.type_name in ("integer", "long"):
            params[key] = _integer(key, values[-1])
        elif member.type_name == "boolean":
            params[key] = {"true": True, "false": False}.get(values[-1].lower(), values[-1])
        elif member.type_name == "timestamp":
            value = values[-1]
            try:
                params[key] = float(value)
            except ValueError:
                params[key] = value
        else:
            params[key] = values[-1]
    return params


def _make_endpoint(route: Route) -> Callable[..., Any]:
    async def endpoint(request: Request, services: ServicesDep) -> Any:

        params: dict[str, Any] = {}
        if route.query:
            params.update(_query_params(route.operation, request))
        if route.body:
            body = await json_body(request)
            if not isinstance(body, dict):
                raise SerializationException("The request body must be a JSON object.")
            params.update(body)
        for path_param, member in route.path_members.items():
            params[member] = request.path_params[path_param]
        try:
            return await run_in_threadpool(dispatch, services.clusters, route.operation, params)
        except Exception as exc:
            raise as_aws_error(exc) from exc

    endpoint.__name__ = route.operation
    return endpoint


def _openapi_extra(route: Route) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    shape = shapes.service_model().operation_model(route.operation).input_shape
    if route.body:
        content: dict[str, Any] = {"schema": {"$ref": f"#/components/schemas/{shape.name}"}}
        if route.example is not None:
            content["example"] = route.example
        extra["requestBody"] = {"required": True, "content": {"application/json": content}}
    if route.query:
        params = []
        for name, member in shape.members.items():
            if name in route.path_members.values():
                continue
            schema = shapes.shape_to_json_schema(member, {})
            params.append(
                {
                    "name": name,
                    "in": "query",
                    "required": name in shape.required_members,
                    "schema": schema,
                    "description": schema.get("description", ""),
                }
            )
        extra["parameters"] = params
    return extra


_UNAUTHORIZED = (
    "With credentials configured (HPSIM_AUTH__CREDENTIALS): MissingAuthenticationToken, "
    "UnrecognizedClientException or InvalidSignatureException (AWS error shape, docs/security.md)"
)
_TOO_LARGE = "SerializationException: the body is over HPSIM_LIMITS__MAX_BODY_BYTES"

for _route in ROUTES:
    _output = shapes.service_model().operation_model(_route.operation).output_shape
    router.add_api_route(
        _route.path,
        _make_endpoint(_route),
        methods=[_route.method],
        summary=_route.summary,
        description=(
            f"The AWS `{_route.operation}` operation over REST: same members, same validation, "
            "same errors as `POST /` with `X-Amz-Target: SageMaker."
            f"{_route.operation}`."
        ),
        operation_id=_route.operation,
        openapi_extra=_openapi_extra(_route),
        responses={
            200: {
                "description": f"{_route.operation} output",
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{_output.name}"}
                        if _output is not None
                        else {"type": "object"}
                    }
                },
            },
            400: {"description": "ValidationException and other client errors (AWS error shape)"},
            401: {"description": _UNAUTHORIZED},
            404: {"description": "ResourceNotFound"},
            409: {"description": "ResourceInUse or ConflictException"},
            413: {"description": _TOO_LARGE},
        },
    )


@router.get(
    "/clusters/{name}/agent-bootstrap",
    summary="How to start an agent for this cluster (external provisioning)",
    description="hyperpod-sim extension. The cluster's bootstrap token and the command that starts an "
    "agent which registers with it and is bound to a pending node slot (docs/agent-protocol.md). "
    "With the local provisioner the control plane starts agents itself.",
    tags=["agents"],
)
async def agent_bootstrap(name: str, services: ServicesDep) -> dict[str, str]:

    try:
        cluster = await run_in_threadpool(lambda: services.clusters.agent_bootstrap(name=name))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    url = services.settings.control_plane_url()
    return {
        "ClusterName": cluster.name,
        "ControlPlaneUrl": url,
        "BootstrapToken": cluster.bootstrap_token,
        "Command": f"HPSIM_AGENT_TOKEN={cluster.bootstrap_token} hyperpod-sim agent "
        f"--control-plane {url} --cluster {cluster.name}",
    }


CHECKPOINT_POLICY_EXAMPLE = {
    "S3BaseUri": "s3://my-checkpoints/llama",
    "PersistEverySteps": 100,
    "PersistEverySeconds": 1800,
    "S3Retention": 5,
    "InMemoryRetention": 3,
    "ReplicationFactor": 1,
    "AgentAccess": "Open",
}
CHECKPOINT_POLICY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "S3BaseUri": {
            "type": ["string", "null"],
            "maxLength": 1024,
            "description": "s3://bucket[/prefix] where agents persist complete steps; null: no S3 tier.",
        },
        "PersistEverySteps": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Persist every N steps.",
        },
        "PersistEverySeconds": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Persist at least every T seconds.",
        },
        "S3Retention": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "Keep the newest K persisted steps on S3; null: keep all.",
        },
        "InMemoryRetention": {
            "type": "integer",
            "minimum": 1,
            "maximum": 100,
            "default": 3,
            "description": "Steps kept in memory per namespace; a trainer may ask for fewer.",
        },
        "ReplicationFactor": {
            "type": "integer",
            "minimum": 0,
            "maximum": 3,
            "default": 1,
            "description": "Copies of each shard on the next nodes of the ring.",
        },
        "AgentAccess": {
            "type": "string",
            "enum": ["Open", "Token"],
            "default": "Open",
            "description": "Who may write to the agents' checkpoint routes. Open: anyone who reaches an "
            "agent (the amzn-sagemaker-checkpointing library sends no credentials). Token: saves, "
            "namespace creation, deletes and cluster/reset on /v1/cp, and every /v1/fast route, need "
            "`Authorization: Bearer <checkpoint token>` (GET /clusters/{name}/checkpoint-token); reads "
            "stay open, so the library can still restore but not save (docs/memory-tier.md).",
        },
    },
}


async def _policy_answer(cluster: Any, policy: Any) -> dict[str, Any]:
    return {
        "ClusterName": cluster.name,
        "ClusterArn": cluster.arn,
        **policy.to_wire(),
        "PolicyGeneration": cluster.generation,
    }


@router.get(
    "/clusters/{name}/checkpoint-policy",
    summary="The cluster's checkpoint policy (hyperpod-sim extension)",
    description="Where and how often agents persist complete steps to S3, S3 and in-memory "
    "retention, the replication factor, and who may write to the agents' checkpoint routes "
    "(`AgentAccess`). Defaults until set: no S3 tier, in-memory retention 3, one replica, Open.",
    tags=["checkpointing"],
    responses={200: {"content": {"application/json": {"example": CHECKPOINT_POLICY_EXAMPLE}}}},
)
async def get_checkpoint_policy(name: str, services: ServicesDep) -> dict[str, Any]:
    try:
        cluster, policy = await run_in_threadpool(lambda: services.clusters.checkpoint_policy(name=name))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return await _policy_answer(cluster, policy)


@router.put(
    "/clusters/{name}/checkpoint-policy",
    summary="Replace the cluster's checkpoint policy (hyperpod-sim extension)",
    description="Omitted members take their defaults. Rolls out like UpdateCluster: the cluster is "
    "Updating until every agent applied the new policy generation. Errors in the AWS shape "
    "(ValidationException naming each bad member, ConflictException unless InService).",
    tags=["checkpointing"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": CHECKPOINT_POLICY_SCHEMA, "example": CHECKPOINT_POLICY_EXAMPLE}
            },
        }
    },
)
async def put_checkpoint_policy(name: str, request: Request, services: ServicesDep) -> dict[str, Any]:
    body = await json_body(request)
    try:
        cluster, policy = await run_in_threadpool(
            lambda: services.clusters.put_checkpoint_policy(name=name, body=body)
        )
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return await _policy_answer(cluster, policy)


@router.get(
    "/clusters/{name}/checkpoint-token",
    summary="The cluster's checkpoint token (hyperpod-sim extension)",
    description="What trainers send to the agents' checkpoint routes (`Authorization: Bearer <token>`, "
    "or `HPSIM_CHECKPOINT_TOKEN` for the SDK) when the checkpoint policy's `AgentAccess` is `Token`. "
    "Made with the cluster; agents get only its SHA-256. As secret as the control plane's own "
    "credentials: with control-plane auth off, anyone who reaches the control plane can read it.",
    tags=["checkpointing"],
    responses={
        200: {
            "content": {
                "application/json": {
                    "example": {
                        "ClusterName": "demo",
                        "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
                        "AgentAccess": "Token",
                        "CheckpointToken": "3f1c...",
                    }
                }
            }
        },
        404: {"description": "ResourceNotFound"},
    },
)
async def get_checkpoint_token(name: str, services: ServicesDep) -> dict[str, Any]:
    try:
        cluster, policy = await run_in_threadpool(lambda: services.clusters.checkpoint_policy(name=name))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return {
        "ClusterName": cluster.name,
        "ClusterArn": cluster.arn,
        "AgentAccess": policy.agent_access,
        "CheckpointToken": cluster.checkpoint_token,
    }


CHECKPOINTS_EXAMPLE = {
    "ClusterName": "demo",
    "Namespaces": [
        {
            "Namespace": "llama",
            "NumRanks": 3,
            "StepsRetained": 3,
            "Steps": [
                {
                    "Step": 200,
                    "Memory": {
                        "0": "i-0a1b2c3d4e5f60718",
                        "1": "i-0f1e2d3c4b5a69788",
                        "2": "i-0a1b2c3d4e5f60718",
                    },
                    "Replica": {"0": ["i-0f1e2d3c4b5a69788"], "2": ["i-0f1e2d3c4b5a69788"]},
                    "S3": True,
                    "Complete": True,
                },
                {"Step": 100, "Memory": {}, "Replica": {}, "S3": True, "Complete": True},
            ],
        }
    ],
    "Unreachable": [],
}


@router.get(
    "/clusters/{name}/checkpoints",
    summary="Where the cluster's checkpoints are held (hyperpod-sim extension)",
    description="Every checkpoint namespace of the cluster with its steps, newest first: for each "
    "rank, the node holding its primary copy in memory (`Memory`) and the nodes holding a replica "
    "(`Replica`); whether the step is committed on S3 (`S3`); and whether it can be restored "
    "(`Complete`: every rank is held in memory somewhere, or the step is on S3). The control plane "
    "asks the agent of every Running node, in parallel with a short timeout; agents that do not "
    "answer are left out of the view and named in `Unreachable`.",
    tags=["checkpointing"],
    responses={
        200: {"content": {"application/json": {"example": CHECKPOINTS_EXAMPLE}}},
        404: {"description": "ResourceNotFound"},
    },
)
async def list_checkpoints(name: str, services: ServicesDep) -> dict[str, Any]:
    try:
        listing = await run_in_threadpool(lambda: services.checkpoints.list_checkpoints(name=name))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return listing.to_wire()


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
FAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["Type"],
    "properties": {
        "Type": {
            "type": "string",
            "enum": list(FAULT_TYPES),
            "description": "Node faults (AgentCrash, NodeLoss, AgentHang, NetworkPartition) need "
            "InstanceId and the local "
            "provisioner; S3 faults act on every agent of the cluster, one at a time.",
        },
        "InstanceId": {"type": "string", "maxLength": 19, "description": "The node (node faults only)."},
        "DurationSeconds": {
            "type": "integer",
            "minimum": 1,
            "maximum": 86400,
            "description": "AgentHang and NetworkPartition (required), S3 faults (optional: until cleared).",
        },
        "LatencyMs": {
            "type": "integer",
            "minimum": 1,
            "maximum": 60000,
            "description": "S3Latency: per request.",
        },
        "ErrorRate": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "description": "S3Errors: the share of S3 requests that fail.",
        },
        "ErrorKind": {
            "type": "string",
            "enum": ["Throttle", "InternalError"],
            "default": "Throttle",
            "description": "S3Errors: 503 SlowDown or 500 InternalError; botocore retries both.",
        },
    },
}
_FAULT_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "ValidationException naming each bad member (AWS error shape)"},
    403: {
        "description": "AccessDeniedException: once HPSIM_AUTH__ADMIN_CREDENTIALS is set, only those keys "
        "may inject and clear faults"
    },
    404: {"description": "ResourceNotFound: unknown cluster, node or fault"},
    409: {"description": "ConflictException: the cluster or node is not in a state to take the fault"},
}


@router.post(
    "/clusters/{name}/faults",
    status_code=201,
    dependencies=[AdminDep],
    summary="Inject a fault (hyperpod-sim extension)",
    description="Node faults act on one node's agent process (local provisioner only): `AgentCrash` "
    "kills it (SIGKILL; the control plane restarts it on the same node, which keeps its id and "
    "shared memory), `NodeLoss` kills it and wipes the node's shared memory (the node fails after "
    "the heartbeat timeout and, with NodeRecovery Automatic, is replaced), `AgentHang` stops it "
    "(SIGSTOP) for `DurationSeconds` (past the heartbeat timeout the node fails as if lost), "
    "`NetworkPartition` cuts the node and the control plane off from each other for "
    "`DurationSeconds` (trainers, peer agents and S3 still reach it, so checkpointing goes on; the "
    "control plane fails the node after the heartbeat timeout, and with NodeRecovery None it "
    "recovers when the partition heals). S3 "
    "faults act on the S3 requests of every agent of the cluster, carried in the node policy (a new "
    "policy generation, pushed without changing the cluster's status): `S3Latency` delays each "
    "request, `S3Errors` answers a share of them 503 SlowDown or 500 InternalError, `S3Outage` fails "
    "them all. Every injection and every end is a cluster event.",
    tags=["faults"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": FAULT_SCHEMA, "examples": FAULT_EXAMPLES}},
        }
    },
    responses={201: {"content": {"application/json": {"example": FAULT_ANSWER_EXAMPLE}}}, **_FAULT_ERRORS},
)
async def inject_fault(name: str, request: Request, services: ServicesDep) -> dict[str, Any]:
    body = await json_body(request)
    try:
        cluster, fault = await run_in_threadpool(lambda: services.faults.inject_fault(name=name, body=body))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return {"ClusterName": cluster.name, **fault}


@router.get(
    "/clusters/{name}/faults",
    summary="The faults in force (hyperpod-sim extension)",
    description="Faults in force, oldest first: S3 faults and hangs until they end or are cleared, a "
    "NodeLoss until the control plane has failed the node. An AgentCrash is over once injected and "
    "is not listed; its traces are the cluster's events.",
    tags=["faults"],
    responses={
        200: {
            "content": {
                "application/json": {
                    "example": {
                        "ClusterName": "demo",
                        "Faults": [{k: v for k, v in FAULT_ANSWER_EXAMPLE.items() if k != "ClusterName"}],
                    }
                }
            }
        },
        404: _FAULT_ERRORS[404],
    },
)
async def list_faults(name: str, services: ServicesDep) -> dict[str, Any]:
    try:
        cluster, found = await run_in_threadpool(lambda: services.faults.list_faults(name=name))
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return {"ClusterName": cluster.name, "Faults": found}


@router.delete(
    "/clusters/{name}/faults/{fault_id}",
    dependencies=[AdminDep],
    summary="End a fault now (hyperpod-sim extension)",
    description="Ends an S3 fault (a new policy generation without it is pushed to the agents) or an "
    "AgentHang (SIGCONT) or a NetworkPartition (healed) before its time. A NodeLoss cannot be "
    "undone (ValidationException); an "
    "unknown or already ended fault is ResourceNotFound.",
    tags=["faults"],
    responses={
        200: {
            "content": {"application/json": {"example": {**FAULT_ANSWER_EXAMPLE, "ClearedAt": 1764460830.0}}}
        },
        **_FAULT_ERRORS,
    },
)
async def clear_fault(name: str, fault_id: str, services: ServicesDep) -> dict[str, Any]:
    try:
        cluster, fault = await run_in_threadpool(
            lambda: services.faults.clear_fault(name=name, fault_id=fault_id)
        )
    except Exception as exc:
        raise as_aws_error(exc) from exc
    return {"ClusterName": cluster.name, **fault}


CONTROL_PLANE_FAULT_ANSWER = {
    "FaultId": "f-9b1c07e24a6d3f85",
    "Type": "DatabaseOutage",
    "DurationSeconds": 10,
    "InjectedAt": 1764460800.0,
    "EndsAt": 1764460810.0,
}


@router.post(
    "/faults",
    status_code=201,
    dependencies=[AdminDep],
    summary="Make this control plane's database unreachable (hyperpod-sim extension)",
    description="`DatabaseOutage` for `DurationSeconds` (1..3600): every statement and commit of this "
    "control plane process fails as if the database server had gone away. Meanwhile the AWS JSON "
    "entry and the REST routes answer 503 `ServiceUnavailable` in the AWS shape (botocore retries "
    "it), agent calls answer 503 (agents retry), a transaction it interrupts is rolled back whole, "
    "and the reconciler's passes fail and are retried. When it ends, by time or by `DELETE`, every "
    "cluster's events record it, and nodes get a heartbeat timeout's grace from the end. The fault "
    "lives in this process only (the database cannot hold it); this route and the two below "
    "answer during the outage. Its injection is recorded in every cluster's events.",
    tags=["faults"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["Type", "DurationSeconds"],
                        "properties": {
                            "Type": {"type": "string", "enum": list(CONTROL_PLANE_FAULTS)},
                            "DurationSeconds": {"type": "integer", "minimum": 1, "maximum": MAX_OUTAGE_S},
                        },
                    },
                    "example": {"Type": "DatabaseOutage", "DurationSeconds": 10},
                }
            },
        }
    },
    responses={
        201: {"content": {"application/json": {"example": CONTROL_PLANE_FAULT_ANSWER}}},
        400: _FAULT_ERRORS[400],
        409: {"description": "ConflictException: an outage is in force already"},
    },
)
async def inject_control_plane_fault(request: Request, services: ServicesDep) -> dict[str, Any]:
    body = await json_body(request)
    try:
        return await run_in_threadpool(lambda: services.faults.inject_control_plane_fault(body=body))
    except Exception as exc:
        raise as_aws_error(exc) from exc


@router.get(
    "/faults",
    summary="This control plane's faults in force (hyperpod-sim extension)",
    description="The DatabaseOutage in force, if any.",
    tags=["faults"],
    responses={200: {"content": {"application/json": {"example": {"Faults": [CONTROL_PLANE_FAULT_ANSWER]}}}}},
)
async def list_control_plane_faults(services: ServicesDep) -> dict[str, Any]:
    return {"Faults": services.faults.list_control_plane_faults()}


@router.delete(
    "/faults/{fault_id}",
    dependencies=[AdminDep],
    summary="End this control plane's fault now (hyperpod-sim extension)",
    description="Ends a DatabaseOutage before its time; an unknown or ended fault is ResourceNotFound.",
    tags=["faults"],
    responses={
        200: {
            "content": {
                "application/json": {"example": {**CONTROL_PLANE_FAULT_ANSWER, "ClearedAt": 1764460805.0}}
            }
        },
        404: _FAULT_ERRORS[404],
    },
)
async def clear_control_plane_fault(fault_id: str, services: ServicesDep) -> dict[str, Any]:
    try:
        return await run_in_threadpool(lambda: services.faults.clear_control_plane_fault(fault_id=fault_id))
    except Exception as exc:
        raise as_aws_error(exc) from exc


def _aws_json_entry_doc() -> dict[str, Any]:
    """OpenAPI entry for ``POST /``, which api/awsjson.py serves in front of the routes."""
    return {
        "tags": ["aws"],
        "summary": "AWS JSON 1.1 entry point (boto3, AWS CLI, sagemaker-core)",
        "description": (
            "The SageMaker wire protocol. The operation is named by the `X-Amz-Target` header, "
            "the body is the operation's input as JSON, timestamps are epoch seconds. With "
            "credentials configured (HPSIM_AUTH__CREDENTIALS) every call must be SigV4-signed with "
            "one of them (UnrecognizedClientException, InvalidSignatureException, "
            "IncompleteSignature, MissingAuthenticationToken otherwise); without, signatures are "
            "not checked. Operations: "
            + ", ".join(f"`{name}`" for name in sorted(OPERATIONS))
            + ". Errors: HTTP 400 (500/503 for service faults) with "
            '`{"__type": "<Code>", "message": "..."}`, which botocore raises as the modelled '
            "exception."
        ),
        "operationId": "AwsJson",
        "parameters": [
            {
                "name": "X-Amz-Target",
                "in": "header",
                "required": True,
                "schema": {"type": "string", "example": "SageMaker.DescribeCluster"},
                "description": "`SageMaker.<Operation>`",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/x-amz-json-1.1": {
                    "schema": {"type": "object"},
                    "example": {"ClusterName": "demo"},
                }
            },
        },
        "responses": {
            "200": {"description": "The operation's output as JSON"},
            "400": {"description": 'AWS error: `{"__type": "<Code>", "message": "..."}`'},
        },
    }


def install_openapi(app: FastAPI) -> None:
    """Add the botocore-derived schemas of every routed operation to the OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        components: dict[str, dict[str, Any]] = {}
        for route in ROUTES:
            operation = shapes.service_model().operation_model(route.operation)
            for shape in (operation.input_shape, operation.output_shape):
                if shape is not None:
                    shapes.shape_to_json_schema(shape, components)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        # The browser's way in (api/gate.py): Swagger UI's Authorize button sends the bearer token.
        schema["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "hpsim1.<access key id>.<mac>: `hyperpod-sim auth-token` prints it "
                "(docs/security.md). SigV4 (boto3, the AWS CLI) is accepted as well.",
            }
        }
        schema["security"] = [{"bearer": []}]
        for path, operations in schema["paths"].items():
            if path in OPEN_PATHS or path.startswith(AGENT_PREFIX):  # outside the access keys
                for operation in operations.values():
                    operation["security"] = []
        schema["paths"]["/"] = {"post": _aws_json_entry_doc()}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
