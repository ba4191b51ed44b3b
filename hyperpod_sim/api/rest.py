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

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from hyperpod_sim.api import shapes
from hyperpod_sim.api.deps import ServicesDep, parse_json
from hyperpod_sim.api.registry import dispatch
from hyperpod_sim.domain.errors import (
    AwsError,
    ConflictException,
    ResourceInUse,
    ResourceNotFound,
    SerializationException,
    validation_error,
)

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
    # What the OpenAPI description adds to the generic sentence (what the operation does here).
    notes: str = ""


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
    # Node operations: what they do to the agents and the checkpoint tiers is in
    # docs/node-operations.md. One row per operation, under the cluster its ClusterName names; an
    # operation naming its clusters by ARN in the body (MoveClusterNodes: SourceClusterArn,
    # TargetClusterArn) takes a body-only path instead, as /cluster-node-volumes does.
    Route(
        "POST",
        "/cluster-nodes/move",
        "MoveClusterNodes",
        "Move running nodes into another instance group (of this or another cluster)",
        body=True,
        example={
            "SourceClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/a1b2c3d4e5f6",
            "SourceInstanceGroupName": "workers",
            "TargetClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/f6e5d4c3b2a1",
            "TargetInstanceGroupName": "workers",
            "NodeIds": ["i-0123456789abcdef0"],
        },
        notes="Each node keeps its instance id and NodeLogicalId: DetachInProgress in the source "
        "(its agent stops after persisting its unpersisted steps to the source's S3, its shared "
        "memory is cleared), then AttachInProgress in the target, Running once its new agent applies "
        "the target's policy.",
    ),
    Route(
        "POST",
        "/clusters/{name}/nodes/batch-reboot",
        "BatchRebootClusterNodes",
        "Reboot nodes by id or logical id",
        {"name": "ClusterName"},
        body=True,
        example={"NodeIds": ["i-0123456789abcdef0"]},
        notes="Each node keeps its id: its agent stops (after persisting its unpersisted steps to S3), "
        "its shared memory is cleared, and it is Pending until its agent is back. Nodes that cannot be "
        "rebooted are answered in `Failed`.",
    ),
    Route(
        "POST",
        "/clusters/{name}/nodes/batch-replace",
        "BatchReplaceClusterNodes",
        "Replace nodes by id or logical id",
        {"name": "ClusterName"},
        body=True,
        example={"NodeIds": ["i-0123456789abcdef0"]},
        notes="Each node shuts down as a deleted one (its agent persists its unpersisted steps to S3 "
        "first; its shared memory goes) and a new node, with a new instance id, takes its slot in the "
        "replica ring; the group's target count stays. Nodes that cannot be replaced are answered in "
        "`Failed`.",
    ),
    Route(
        "POST",
        "/clusters/{name}/nodes/batch-add",
        "BatchAddClusterNodes",
        "Add nodes to instance groups (NodeProvisioningMode Continuous)",
        {"name": "ClusterName"},
        body=True,
        example={
            "NodesToAdd": [{"InstanceGroupName": "workers", "IncrementTargetCountBy": 2}],
            "ClientToken": "add-workers-1",
        },
        notes="Each node added is answered with its `NodeLogicalId` at once, Pending; the groups' "
        "target counts rise and the cluster stays InService. A retry with the same `ClientToken` and "
        "`NodesToAdd` within 8 hours adds nothing and answers the same nodes with their status now.",
    ),
    Route(
        "POST",
        "/clusters/{name}/software-update",
        "UpdateClusterSoftware",
        "Update the nodes' image release, batch by batch",
        {"name": "ClusterName"},
        body=True,
        example={
            "InstanceGroups": [{"InstanceGroupName": "workers", "ImageReleaseVersion": "1.1.0"}],
            "DeploymentConfig": {
                "RollingUpdatePolicy": {"MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": 1}},
                "WaitIntervalInSeconds": 30,
            },
        },
        notes="The cluster is SystemUpdating while the update rolls, InService again after; the "
        "groups' `SoftwareUpdateStatus` is InProgress, then Succeeded until their next update. An "
        "empty body updates every group to the latest release in one batch.",
    ),
    Route(
        "POST",
        "/clusters/{name}/health-checks",
        "StartClusterHealthCheck",
        "Run deep health checks on instance groups",
        {"name": "ClusterName"},
        body=True,
        example={
            "DeepHealthCheckConfigurations": [
                {"InstanceGroupName": "workers", "DeepHealthChecks": ["InstanceStress"]}
            ]
        },
        notes="The nodes checked are DeepHealthCheckInProgress, then Running again (Failure only "
        "under a DeepHealthCheckFailure fault); the check is recorded as a DeepHealthCheck operation.",
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
    # Cluster operation records (apiops, issue 15).
    Route(
        "GET",
        "/clusters/{name}/operations",
        "ListClusterOperations",
        "List a cluster's operations (scaling, node operations), newest first",
        {"name": "ClusterName"},
        query=True,
    ),
    Route(
        "GET",
        "/clusters/{name}/operations/{operation_id}",
        "DescribeClusterOperation",
        "Describe one cluster operation",
        {"name": "ClusterName", "operation_id": "OperationId"},
    ),
    # Cluster scheduler configs (apiops, issue 15).
    Route(
        "POST",
        "/cluster-scheduler-configs",
        "CreateClusterSchedulerConfig",
        "Create a cluster's scheduler config (task governance policy)",
        body=True,
        example={
            "Name": "policy",
            "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
            "SchedulerConfig": {
                "PriorityClasses": [{"Name": "training", "Weight": 80}],
                "FairShare": "Enabled",
            },
        },
    ),
    Route(
        "GET",
        "/cluster-scheduler-configs",
        "ListClusterSchedulerConfigs",
        "List scheduler configs",
        query=True,
    ),
    Route(
        "GET",
        "/cluster-scheduler-configs/{config_id}",
        "DescribeClusterSchedulerConfig",
        "Describe a scheduler config (its latest version, or ClusterSchedulerConfigVersion)",
        {"config_id": "ClusterSchedulerConfigId"},
        query=True,
    ),
    Route(
        "PATCH",
        "/cluster-scheduler-configs/{config_id}",
        "UpdateClusterSchedulerConfig",
        "Update a scheduler config (TargetVersion: its current version)",
        {"config_id": "ClusterSchedulerConfigId"},
        body=True,
    ),
    Route(
        "DELETE",
        "/cluster-scheduler-configs/{config_id}",
        "DeleteClusterSchedulerConfig",
        "Delete a scheduler config",
        {"config_id": "ClusterSchedulerConfigId"},
    ),
    # Cluster extensions (apiops, issue 15): named by ARN, so in the query or body, as /tags does.
    Route(
        "POST",
        "/cluster-extensions",
        "CreateClusterExtension",
        "Install an extension on a Slurm cluster (NodeProvisioningMode Continuous)",
        body=True,
        example={
            "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
            "ExtensionName": "sagemaker-observability",
        },
    ),
    Route("GET", "/cluster-extensions", "ListClusterExtensions", "List a cluster's extensions", query=True),
    Route(
        "GET", "/cluster-extensions/describe", "DescribeClusterExtension", "Describe an extension", query=True
    ),
    Route("PATCH", "/cluster-extensions", "UpdateClusterExtension", "Update an extension", body=True),
    Route("POST", "/cluster-extensions/delete", "DeleteClusterExtension", "Delete an extension", body=True),
    Route(
        "GET",
        "/cluster-extension-versions/{extension_name}",
        "ListClusterExtensionVersions",
        "List the versions of an extension on offer, highest first",
        {"extension_name": "ExtensionName"},
        query=True,
    ),
    # Volumes and network interfaces attached to nodes (apiops, issue 15).
    Route(
        "POST",
        "/clusters/{name}/nodes/{node_id}/network-interfaces",
        "AttachClusterNodeNetworkInterface",
        "Attach a network interface to a node",
        {"name": "ClusterName", "node_id": "NodeId"},
        body=True,
        example={"NetworkInterfaceId": "eni-0123456789abcdef0"},
    ),
    Route(
        "POST",
        "/cluster-node-volumes/attach",
        "AttachClusterNodeVolume",
        "Attach an EBS volume to a node of an EKS cluster",
        body=True,
    ),
    Route(
        "POST",
        "/cluster-node-volumes/detach",
        "DetachClusterNodeVolume",
        "Detach an EBS volume from a node",
        body=True,
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
        return await run_in_threadpool(dispatch, services, route.operation, params)

    endpoint.__name__ = route.operation
    return endpoint


def _body_schema(route: Route, shape: Any) -> dict[str, Any]:
    """The input structure, less the members the path gives (the path's value is the one used)."""
    if not route.path_members:
        return {"$ref": f"#/components/schemas/{shape.name}"}
    components: dict[str, dict[str, Any]] = {}
    shapes.shape_to_json_schema(shape, components)
    schema = dict(components[shape.name])
    located = set(route.path_members.values())
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in located}
    required = [name for name in schema.get("required", ()) if name not in located]
    schema.pop("required", None)
    if required:
        schema["required"] = required
    return schema


def _openapi_extra(route: Route) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    shape = shapes.service_model().operation_model(route.operation).input_shape
    if route.body:
        content: dict[str, Any] = {"schema": _body_schema(route, shape)}
        if route.example is not None:
            content["example"] = route.example
        extra["requestBody"] = {"required": True, "content": {"application/json": content}}
    params: list[dict[str, Any]] = []
    for parameter, member_name in route.path_members.items():
        schema = shapes.shape_to_json_schema(shape.members[member_name], {})
        params.append(
            {
                "name": parameter,
                "in": "path",
                "required": True,
                "schema": schema,
                "description": f"The input's `{member_name}`. " + schema.pop("description", ""),
            }
        )
    extra["parameters"] = params
    if route.query:
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
    return extra


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
            f"{_route.operation}`." + (f" {_route.notes}" if _route.notes else "")
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
            404: {"description": "ResourceNotFound"},
            409: {"description": "ResourceInUse or ConflictException"},
        },
    )


def _strings(*names: str) -> dict[str, Any]:
    """The schema of an answer whose members are all strings, all present."""
    return {
        "type": "object",
        "properties": {name: {"type": "string"} for name in names},
        "required": list(names),
        "additionalProperties": False,
    }


@router.get(
    "/clusters/{name}/agent-bootstrap",
    operation_id="GetAgentBootstrap",
    summary="How to start an agent for this cluster (external provisioning)",
    description="hyperpod-sim extension. The cluster's bootstrap token and the command that starts an "
    "agent which registers with it and is bound to a pending node slot (docs/agent-protocol.md). "
    "With the local provisioner the control plane starts agents itself.",
    tags=["agents"],
    responses={
        200: {
            "content": {
                "application/json": {
                    "schema": _strings("ClusterName", "ControlPlaneUrl", "BootstrapToken", "Command"),
                    "example": {
                        "ClusterName": "demo",
                        "ControlPlaneUrl": "http://127.0.0.1:8080",
                        "BootstrapToken": "b1f0...",
                        "Command": "HPSIM_AGENT_TOKEN=b1f0... hyperpod-sim agent "
                        "--control-plane http://127.0.0.1:8080 --cluster demo",
                    },
                }
            }
        },
        404: {"description": "ResourceNotFound"},
    },
)
async def agent_bootstrap(name: str, services: ServicesDep) -> dict[str, str]:
    cluster = await run_in_threadpool(lambda: services.clusters.agent_bootstrap(name=name))
    url = services.settings.control_plane_url()
    return {
        "ClusterName": cluster.name,
        "ControlPlaneUrl": url,
        "BootstrapToken": cluster.bootstrap_token,
        "Command": f"HPSIM_AGENT_TOKEN={cluster.bootstrap_token} hyperpod-sim agent "
        f"--control-plane {url} --cluster {cluster.name}",
    }


@router.get(
    "/clusters/{name}/checkpoint-token",
    operation_id="GetCheckpointToken",
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
                    "schema": _strings("ClusterName", "ClusterArn", "AgentAccess", "CheckpointToken"),
                    "example": {
                        "ClusterName": "demo",
                        "ClusterArn": "arn:aws:sagemaker:us-east-1:123456789012:cluster/abcdefghijkl",
                        "AgentAccess": "Token",
                        "CheckpointToken": "3f1c...",
                    },
                }
            }
        },
        404: {"description": "ResourceNotFound"},
    },
)
async def get_checkpoint_token(name: str, services: ServicesDep) -> dict[str, Any]:
    cluster, policy = await run_in_threadpool(lambda: services.clusters.checkpoint_policy(name=name))
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
    operation_id="ListCheckpoints",
    summary="Where the cluster's checkpoints are held (hyperpod-sim extension)",
    description="Every checkpoint namespace of the cluster with its steps, newest first: for each "
    "rank, the node holding its primary copy in memory (`Memory`) and the nodes holding a replica "
    "(`Replica`); whether the step is committed on S3 (`S3`: true or false once S3 was listed; "
    "null when it could not be, S3 being unreachable, with the reason in the namespace's `S3Error`); "
    "and whether it can be restored "
    "(`Complete`: every rank is held in memory somewhere, or the step is on S3). A step saved by a "
    "job of another world size than the namespace's (`NumRanks` less the metadata rank; the SDK "
    "loads it resharded) names that world size in `WorldSize`. The control plane "
    "asks the agent of every Running node, in parallel with a short timeout; agents that do not "
    "answer are left out of the view and named in `Unreachable`.",
    tags=["checkpointing"],
    responses={
        200: {"content": {"application/json": {"example": CHECKPOINTS_EXAMPLE}}},
        404: {"description": "ResourceNotFound"},
    },
)
async def list_checkpoints(name: str, services: ServicesDep) -> dict[str, Any]:
    listing = await run_in_threadpool(lambda: services.checkpoints.list_checkpoints(name=name))
    return listing.to_wire()
