"""The operation registry: AWS operation name -> handler.

A handler takes the app's services (built once: ``api.app.build_services``) and the validated
input (AWS member names, timestamps already ``datetime``), calls the domain with keyword arguments
and shapes the result into the operation's output members. Both transports, the AWS JSON 1.1 entry
and the REST routes, go through :func:`dispatch`, so they share one validation, one behaviour and
one output shape.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from hyperpod_sim.api import shapes
from hyperpod_sim.api.deps import Params, Services
from hyperpod_sim.api.handlers import (
    cluster_extensions,
    members,
    node_attachments,
    operation_records,
    scheduler_configs,
)
from hyperpod_sim.contracts.agent_bodies import S3TierStatus
from hyperpod_sim.domain import cluster_reads
from hyperpod_sim.domain.errors import UnknownOperationException
from hyperpod_sim.domain.node_batch import NodeBatch
from hyperpod_sim.models import Cluster, ClusterEvent, InstanceGroup, Node
from hyperpod_sim.models.groups import ClusterExtra, InstanceGroupSpec, ResourceTag, TieredStorage
from hyperpod_sim.models.node_sets import AddClusterNodeSpecification, MoveRequest
from hyperpod_sim.models.software_update import (
    DeploymentConfig,
    GroupRelease,
    HealthCheckConfiguration,
    SoftwareUpdate,
)

Handler = Callable[[Services, Params], dict[str, Any]]


# ---------------------------------------------------------------------- output shaping


@lru_cache
def _members(shape_name: str) -> frozenset[str]:
    return frozenset(shapes.service_model().shape_for(shape_name).members)


def _group_details(
    group: InstanceGroup, running: int, by_type: dict[str, int], update: SoftwareUpdate | None = None
) -> dict[str, Any]:
    shape = "ClusterRestrictedInstanceGroupDetails" if group.restricted else "ClusterInstanceGroupDetails"
    spec = group.spec.wire()
    out: dict[str, Any] = {
        "CurrentCount": running,
        "TargetCount": group.target_count,
        "InstanceGroupName": group.name,
        "InstanceType": group.instance_type,
        "Status": group.status,
    }
    renamed: dict[str, Any] = {}
    if "MinInstanceCount" in spec:
        renamed["MinCount"] = spec["MinInstanceCount"]
    if "InstanceRequirements" in spec:
        types = spec["InstanceRequirements"]["InstanceTypes"]
        renamed["InstanceRequirements"] = {"CurrentInstanceTypes": types, "DesiredInstanceTypes": types}
    if "ImageId" in spec:
        renamed["CurrentImageId"] = renamed["DesiredImageId"] = spec["ImageId"]
    renamed["KubernetesConfig"] = members.kubernetes_details(spec)
    renamed["AutoPatchConfig"] = members.auto_patch_details(spec)
    renamed.update(members.group_state(group, running, by_type, update))
    allowed = _members(shape)
    for key, value in spec.items():
        if key in allowed and key not in out and key not in _RENAMED_GROUP_MEMBERS:
            out[key] = value
    out.update({k: v for k, v in renamed.items() if k in allowed})
    return out


# Group members whose input shape differs from their output shape (mapped in _group_details).
_RENAMED_GROUP_MEMBERS = ("InstanceRequirements", "KubernetesConfig", "AutoPatchConfig")


def _cluster_description(
    cluster: Cluster, running: dict[str, int], by_type: dict[str, dict[str, int]]
) -> dict[str, Any]:
    groups = [g for g in cluster.instance_groups if not g.restricted]
    restricted = [g for g in cluster.instance_groups if g.restricted]

    def details(g: InstanceGroup) -> dict[str, Any]:
        return _group_details(g, running.get(g.name, 0), by_type.get(g.name, {}), cluster.software_update)

    out: dict[str, Any] = {
        "ClusterArn": cluster.arn,
        "ClusterName": cluster.name,
        "ClusterStatus": cluster.status,
        "CreationTime": cluster.creation_time,
        "FailureMessage": cluster.failure_message,
        "InstanceGroups": [details(g) for g in groups],
        "VpcConfig": cluster.vpc_config,
        "Orchestrator": cluster.orchestrator,
        "TieredStorageConfig": cluster.tiered_storage.wire() if cluster.tiered_storage is not None else None,
        "NodeRecovery": cluster.node_recovery,
    }
    if restricted:
        out["RestrictedInstanceGroups"] = [details(g) for g in restricted]
    out["RestrictedInstanceGroupsConfig"] = members.restricted_config(
        cluster.extra.restricted_instance_groups_config
    )
    out.update({k: v for k, v in cluster.extra.wire().items() if k != "RestrictedInstanceGroupsConfig"})
    if "AutoScaling" in out:
        out["AutoScaling"] = {
            **out["AutoScaling"],
            "Status": "InService" if cluster.status == "InService" else "Creating",
        }
    return out


def _node_status(node: Node) -> dict[str, Any]:
    status: dict[str, Any] = {"Status": node.status}
    if node.status_message:
        status["Message"] = node.status_message
    return status


def _primary_ip(node: Node) -> str:
    """AWS's PrivatePrimaryIp: the node's own address (hyperpod_sim/models/tables.py: Node.address),
    or, for a node without one, the private IP it was given at its launch."""
    return node.address or node.private_ip


def _dns_name(node: Node, region: str) -> str:
    """EC2's private DNS name of the node's PrivatePrimaryIp (``ip-a-b-c-d.<region>.compute.internal``;
    ``ec2.internal`` in us-east-1)."""
    domain = "ec2.internal" if region == "us-east-1" else f"{region}.compute.internal"
    return f"ip-{_primary_ip(node).replace('.', '-')}.{domain}"


def _s3_tier(status: S3TierStatus | None) -> dict[str, Any] | None:
    """The agent's S3 tier as its last heartbeat reported it (checked by domain/nodes/agents.py)."""
    if status is None:
        return None
    return {
        "PendingSteps": status.pending_steps,
        "LagSeconds": status.lag_seconds,
        "PersistedStepsTotal": status.persisted_steps_total,
        "FailuresTotal": status.failures_total,
        "LastPersistedSteps": status.last_persisted,
        "LastError": status.last_error,
    }


def _agent_status(node: Node) -> dict[str, Any] | None:
    """Extension member: the node's agent as the control plane last saw it."""
    if node.endpoint is None and node.last_error is None:
        return None
    return {
        "Endpoint": node.endpoint,
        "AppliedPolicyGeneration": node.acked_generation,
        "LastHeartbeatTime": node.last_heartbeat,
        "LastError": node.last_error,
        "S3Tier": _s3_tier(node.s3_status),
    }


def _node_summary(
    node: Node,
    region: str,
    *,
    logical_ids: bool,
    spec: dict[str, Any],
    update: SoftwareUpdate | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        **members.node_state(spec, details=False, node=node, update=update),
        "AgentStatus": _agent_status(node),
        "InstanceGroupName": node.group_name,
        "InstanceId": node.id,
        "InstanceType": node.instance_type,
        "LaunchTime": node.launch_time,
        "InstanceStatus": _node_status(node),
        "PrivateDnsHostname": _dns_name(node, region),
    }
    if logical_ids:
        out["NodeLogicalId"] = node.logical_id
    return out


def _node_details(node: Node, cluster: Cluster, region: str) -> dict[str, Any]:
    group = next((g for g in cluster.instance_groups if g.name == node.group_name), None)
    spec = group.spec.wire() if group is not None else {}
    update = cluster.software_update
    out = _node_summary(node, region, logical_ids=True, spec=spec, update=update)
    out.update(members.node_state(spec, details=True, node=node, update=update))
    if out["AgentStatus"] is not None:
        out["AgentStatus"]["DesiredPolicyGeneration"] = cluster.generation
    for key in ("LifeCycleConfig", "ThreadsPerCore", "InstanceStorageConfigs", "OverrideVpcConfig"):
        if key in spec:
            out[key] = spec[key]
    if "ImageId" in spec:
        out["CurrentImageId"] = out["DesiredImageId"] = spec["ImageId"]
    out["PrivatePrimaryIp"] = _primary_ip(node)
    out["Placement"] = {
        "AvailabilityZone": f"{region}a",
        "AvailabilityZoneId": members.availability_zone_id(region),
    }
    return out


def _batch(result: NodeBatch) -> dict[str, Any]:
    """BatchDeleteClusterNodes' and MoveClusterNodes' halves of an answer: ``Successful`` and
    ``Failed`` (``Code``, ``Message``, ``NodeId``), or their logical-id twins for nodes named by
    logical id; an empty list is left out (the model's lists hold at least one)."""
    key = "NodeLogicalId" if result.logical else "NodeId"
    out: dict[str, Any] = {}
    if result.successful:
        out["SuccessfulNodeLogicalIds" if result.logical else "Successful"] = result.successful
    if result.failed:
        out["FailedNodeLogicalIds" if result.logical else "Failed"] = [
            {"Code": code, "Message": message, key: node} for node, code, message in result.failed
        ]
    return out


# ---------------------------------------------------------------------- handlers


def create_cluster(services: Services, p: Params) -> dict[str, Any]:
    cluster = services.clusters.create_cluster(
        name=p["ClusterName"],
        instance_groups=_specs(p.get("InstanceGroups")),
        restricted_instance_groups=_specs(p.get("RestrictedInstanceGroups")),
        vpc_config=p.get("VpcConfig"),
        tags=_tags(p.get("Tags")),
        orchestrator=p.get("Orchestrator"),
        node_recovery=p.get("NodeRecovery"),
        tiered_storage=_tiered(p.get("TieredStorageConfig")),
        extra=_extra(p),
    )
    return {"ClusterArn": cluster.arn}


def _specs(groups: list[dict[str, Any]] | None) -> list[InstanceGroupSpec] | None:
    """Validated group specifications as their values, stored as given (members.storable)."""
    if groups is None:
        return None
    return [InstanceGroupSpec.from_wire(members.storable(group)) for group in groups]


def _tiered(config: dict[str, Any] | None) -> TieredStorage | None:
    return TieredStorage.from_wire(config) if config is not None else None


def _tags(tags: list[dict[str, str]] | None) -> list[ResourceTag] | None:
    return [ResourceTag.from_wire(tag) for tag in tags] if tags is not None else None


# Cluster members stored as given (ClusterExtra); DescribeCluster echoes them, RestrictedInstance-
# GroupsConfig mapped (members.restricted_config).
_EXTRA_MEMBERS = ("NodeProvisioningMode", "ClusterRole", "AutoScaling", "RestrictedInstanceGroupsConfig")


def _extra(p: Params) -> ClusterExtra:
    extra: ClusterExtra = ClusterExtra.from_wire({k: p[k] for k in _EXTRA_MEMBERS if k in p})
    return extra


def update_cluster(services: Services, p: Params) -> dict[str, Any]:
    cluster = services.clusters.update_cluster(
        name=p["ClusterName"],
        instance_groups=_specs(p.get("InstanceGroups")),
        restricted_instance_groups=_specs(p.get("RestrictedInstanceGroups")),
        instance_groups_to_delete=p.get("InstanceGroupsToDelete"),
        tiered_storage=_tiered(p.get("TieredStorageConfig")),
        node_recovery=p.get("NodeRecovery"),
        orchestrator=p.get("Orchestrator"),
        extra=_extra(p),
    )
    return {"ClusterArn": cluster.arn}


def describe_cluster(services: Services, p: Params) -> dict[str, Any]:
    cluster, running = services.clusters.describe_cluster(name=p["ClusterName"])
    flexible = any(g.spec.instance_requirements is not None for g in cluster.instance_groups)
    by_type = cluster_reads.running_by_type(services.db, cluster_id=cluster.id) if flexible else {}
    return _cluster_description(cluster, running, by_type)


def delete_cluster(services: Services, p: Params) -> dict[str, Any]:
    return {"ClusterArn": services.clusters.delete_cluster(name=p["ClusterName"]).arn}


def list_clusters(services: Services, p: Params) -> dict[str, Any]:
    page = services.clusters.list_clusters(
        creation_time_after=p.get("CreationTimeAfter"),
        creation_time_before=p.get("CreationTimeBefore"),
        name_contains=p.get("NameContains"),
        training_plan_arn=p.get("TrainingPlanArn"),
        sort_by=p.get("SortBy"),
        sort_order=p.get("SortOrder"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    summaries = []
    for cluster in page.items:
        summary: dict[str, Any] = {
            "ClusterArn": cluster.arn,
            "ClusterName": cluster.name,
            "CreationTime": cluster.creation_time,
            "ClusterStatus": cluster.status,
            "ImageVersionStatus": members.IMAGE_UP_TO_DATE,
        }
        plans = sorted(
            {
                g.spec.training_plan_arn
                for g in cluster.instance_groups
                if g.spec.training_plan_arn is not None
            }
        )
        if plans:
            summary["TrainingPlanArns"] = plans
        summaries.append(summary)
    return {"ClusterSummaries": summaries, "NextToken": page.next_token}


def list_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    page = services.clusters.list_cluster_nodes(
        name=p["ClusterName"],
        creation_time_after=p.get("CreationTimeAfter"),
        creation_time_before=p.get("CreationTimeBefore"),
        instance_group_name_contains=p.get("InstanceGroupNameContains"),
        sort_by=p.get("SortBy"),
        sort_order=p.get("SortOrder"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    logical = bool(p.get("IncludeNodeLogicalIds"))
    region = services.clusters.config.region
    cluster, _ = services.clusters.describe_cluster(name=p["ClusterName"])
    specs = {g.name: g.spec.wire() for g in cluster.instance_groups}
    return {
        "ClusterNodeSummaries": [
            _node_summary(
                n,
                region,
                logical_ids=logical,
                spec=specs.get(n.group_name, {}),
                update=cluster.software_update,
            )
            for n in page.items
        ],
        "NextToken": page.next_token,
    }


def describe_cluster_node(services: Services, p: Params) -> dict[str, Any]:
    node = services.clusters.describe_cluster_node(
        name=p["ClusterName"], node_id=p.get("NodeId"), node_logical_id=p.get("NodeLogicalId")
    )
    cluster, _ = services.clusters.describe_cluster(name=p["ClusterName"])
    return {"NodeDetails": _node_details(node, cluster, services.clusters.config.region)}


def batch_delete_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    by_id, by_logical = services.clusters.batch_delete_cluster_nodes(
        name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
    )
    return {**_batch(by_id), **_batch(by_logical)}


# ---------------------------------------------------------------------- node operations (nodeops)


def _node_results(by_id: NodeBatch, by_logical: NodeBatch) -> dict[str, Any]:
    """The output of BatchReboot/BatchReplaceClusterNodes: ``Successful`` and ``Failed`` (with
    ``ErrorCode``), and their logical-id twins when logical ids were given. A list of successes
    is left out when empty: the model's lists of node ids hold at least one."""
    out: dict[str, Any] = {
        "Failed": [
            {"NodeId": key, "ErrorCode": code, "Message": message} for key, code, message in by_id.failed
        ],
    }
    if by_id.successful:
        out["Successful"] = by_id.successful
    if by_logical.successful or by_logical.failed:
        out["FailedNodeLogicalIds"] = [
            {"NodeLogicalId": key, "ErrorCode": code, "Message": message}
            for key, code, message in by_logical.failed
        ]
        if by_logical.successful:
            out["SuccessfulNodeLogicalIds"] = by_logical.successful
    return out


def batch_reboot_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    return _node_results(
        *services.node_operations.batch_reboot(
            name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
        )
    )


def batch_replace_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    return _node_results(
        *services.node_operations.batch_replace(
            name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
        )
    )


def update_cluster_software(services: Services, p: Params) -> dict[str, Any]:
    groups, deployment = p.get("InstanceGroups"), p.get("DeploymentConfig")
    cluster = services.software_updates.update_cluster_software(
        name=p["ClusterName"],
        instance_groups=None if groups is None else [GroupRelease.from_wire(g) for g in groups],
        deployment_config=None if deployment is None else DeploymentConfig.from_wire(deployment),
        image_id=p.get("ImageId"),
    )
    return {"ClusterArn": cluster.arn}


def batch_add_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    result = services.add_nodes.batch_add(
        name=p["ClusterName"],
        nodes_to_add=[AddClusterNodeSpecification.from_wire(spec) for spec in p["NodesToAdd"]],
        client_token=p.get("ClientToken"),
    )
    return result.wire()


def start_cluster_health_check(services: Services, p: Params) -> dict[str, Any]:
    cluster = services.health_checks.start(
        name=p["ClusterName"],
        configurations=[HealthCheckConfiguration.from_wire(c) for c in p["DeepHealthCheckConfigurations"]],
    )
    return {"ClusterArn": cluster.arn}


def move_cluster_nodes(services: Services, p: Params) -> dict[str, Any]:
    """Successful / Failed for NodeIds and InstanceCount, their logical-id twins for NodeLogicalIds."""
    request = MoveRequest.from_wire({key: value for key, value in p.items() if key != "ClientToken"})
    result = services.moves.move(request=request, client_token=p.get("ClientToken"))
    return _batch(result)


# ---------------------------------------------------------------------- events


def _event(cluster: Cluster, event: ClusterEvent) -> dict[str, Any]:
    return {
        "EventId": event.id,
        "ClusterArn": cluster.arn,
        "ClusterName": cluster.name,
        "InstanceGroupName": event.instance_group_name,
        "InstanceId": event.instance_id,
        "ResourceType": event.resource_type,
        "EventTime": event.event_time,
        "Description": event.description,
        "EventLevel": event.level,
        "OperationId": event.operation_id,
    }


def list_cluster_events(services: Services, p: Params) -> dict[str, Any]:
    cluster, page = services.clusters.list_cluster_events(
        name=p["ClusterName"],
        instance_group_name=p.get("InstanceGroupName"),
        node_id=p.get("NodeId"),
        event_time_after=p.get("EventTimeAfter"),
        event_time_before=p.get("EventTimeBefore"),
        resource_type=p.get("ResourceType"),
        operation_id=p.get("OperationId"),
        # SortBy: EventTime is the model's only sort key, and the one events are sorted by.
        sort_order=p.get("SortOrder"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    return {"Events": [_event(cluster, e) for e in page.items], "NextToken": page.next_token}


def describe_cluster_event(services: Services, p: Params) -> dict[str, Any]:
    cluster, event = services.clusters.describe_cluster_event(name=p["ClusterName"], event_id=p["EventId"])
    described, _ = services.clusters.describe_cluster(name=cluster.arn)
    node = None
    if event.instance_id is not None:
        node = cluster_reads.find_node(services.db, cluster_id=cluster.id, node_id=event.instance_id)
    details = members.event_details(described, event, node, services.clusters.config.region)
    return {"EventDetails": {**_event(cluster, event), "EventDetails": details}}


def add_tags(services: Services, p: Params) -> dict[str, Any]:
    added = services.clusters.add_tags(
        arn=p["ResourceArn"], tags=[ResourceTag.from_wire(t) for t in p["Tags"]]
    )
    return {"Tags": [tag.wire() for tag in added]}


def list_tags(services: Services, p: Params) -> dict[str, Any]:
    page = services.clusters.list_tags(
        arn=p["ResourceArn"], max_results=p.get("MaxResults"), next_token=p.get("NextToken")
    )
    return {"Tags": [{"Key": t.key, "Value": t.value} for t in page.items], "NextToken": page.next_token}


def delete_tags(services: Services, p: Params) -> dict[str, Any]:
    services.clusters.delete_tags(arn=p["ResourceArn"], keys=p["TagKeys"])
    return {}


OPERATIONS: dict[str, Handler] = {
    "CreateCluster": create_cluster,
    "UpdateCluster": update_cluster,
    "DescribeCluster": describe_cluster,
    "DeleteCluster": delete_cluster,
    "ListClusters": list_clusters,
    "ListClusterNodes": list_cluster_nodes,
    "DescribeClusterNode": describe_cluster_node,
    "BatchDeleteClusterNodes": batch_delete_cluster_nodes,
    # Node operations (nodeops: hyperpod_sim/domain/node_operations/reboot_replace.py).
    "BatchRebootClusterNodes": batch_reboot_cluster_nodes,
    "BatchReplaceClusterNodes": batch_replace_cluster_nodes,
    "UpdateClusterSoftware": update_cluster_software,
    "BatchAddClusterNodes": batch_add_cluster_nodes,
    "StartClusterHealthCheck": start_cluster_health_check,
    "MoveClusterNodes": move_cluster_nodes,
    "ListClusterEvents": list_cluster_events,
    "DescribeClusterEvent": describe_cluster_event,
    "AddTags": add_tags,
    "ListTags": list_tags,
    "DeleteTags": delete_tags,
    # Cluster operation records (apiops, issue 15).
    "DescribeClusterOperation": operation_records.describe_cluster_operation,
    "ListClusterOperations": operation_records.list_cluster_operations,
    # Cluster scheduler configs, task governance's cluster policy (apiops, issue 15).
    "CreateClusterSchedulerConfig": scheduler_configs.create_cluster_scheduler_config,
    "DescribeClusterSchedulerConfig": scheduler_configs.describe_cluster_scheduler_config,
    "ListClusterSchedulerConfigs": scheduler_configs.list_cluster_scheduler_configs,
    "UpdateClusterSchedulerConfig": scheduler_configs.update_cluster_scheduler_config,
    "DeleteClusterSchedulerConfig": scheduler_configs.delete_cluster_scheduler_config,
    # Cluster extensions (apiops, issue 15).
    "CreateClusterExtension": cluster_extensions.create_cluster_extension,
    "DescribeClusterExtension": cluster_extensions.describe_cluster_extension,
    "ListClusterExtensions": cluster_extensions.list_cluster_extensions,
    "UpdateClusterExtension": cluster_extensions.update_cluster_extension,
    "DeleteClusterExtension": cluster_extensions.delete_cluster_extension,
    "ListClusterExtensionVersions": cluster_extensions.list_cluster_extension_versions,
    # Volumes and network interfaces attached to nodes (apiops, issue 15).
    "AttachClusterNodeVolume": node_attachments.attach_cluster_node_volume,
    "DetachClusterNodeVolume": node_attachments.detach_cluster_node_volume,
    "AttachClusterNodeNetworkInterface": node_attachments.attach_cluster_node_network_interface,
}


def dispatch(services: Services, operation: str, body: object) -> dict[str, Any]:
    """Validate ``body`` against the operation's input shape, run it, serialize the output."""
    handler = OPERATIONS.get(operation)
    if handler is None:
        raise UnknownOperationException(
            f"Operation {operation} is not supported by hyperpod-sim. Supported operations: "
            f"{', '.join(sorted(OPERATIONS))}."
        )
    params = shapes.validate_input(operation, body)
    return shapes.serialize_output(operation, handler(services, params))
