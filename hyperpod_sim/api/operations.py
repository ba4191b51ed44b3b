"""The operation registry: AWS operation name -> handler.

A handler takes the validated input (AWS member names, timestamps already ``datetime``), calls the
domain with keyword arguments and shapes the result into the operation's output members. Both
transports, the AWS JSON 1.1 entry and the REST routes, go through :func:`dispatch`, so they
share one validation, one behaviour and one output shape.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from hyperpod_sim.api import (
    cluster_extensions,
    members,
    node_attachments,
    operation_records,
    scheduler_configs,
    shapes,
)
from hyperpod_sim.domain import cluster_reads
from hyperpod_sim.domain.add_nodes import AddNodesService
from hyperpod_sim.domain.clusters import EXTRA_MEMBERS, ClusterService, NodeDeletion
from hyperpod_sim.domain.errors import UnknownOperationException
from hyperpod_sim.domain.health_checks import HealthCheckService
from hyperpod_sim.domain.move_nodes import MoveNodesService
from hyperpod_sim.domain.node_operations import NodeOperations, NodeResults
from hyperpod_sim.domain.software_update import SoftwareUpdateService
from hyperpod_sim.models import Cluster, ClusterEvent, InstanceGroup, Node

Params = dict[str, Any]
Handler = Callable[[ClusterService, Params], dict[str, Any]]


# ---------------------------------------------------------------------- output shaping


@lru_cache
def _members(shape_name: str) -> frozenset[str]:
    return frozenset(shapes.service_model().shape_for(shape_name).members)


def _group_details(
    group: InstanceGroup, running: int, by_type: dict[str, int], update: dict[str, Any] | None = None
) -> dict[str, Any]:
    shape = "ClusterRestrictedInstanceGroupDetails" if group.restricted else "ClusterInstanceGroupDetails"
    spec = group.spec
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
        "TieredStorageConfig": cluster.tiered_storage,
        "NodeRecovery": cluster.node_recovery,
    }
    if restricted:
        out["RestrictedInstanceGroups"] = [details(g) for g in restricted]
    out["RestrictedInstanceGroupsConfig"] = members.restricted_config(
        cluster.extra.get("RestrictedInstanceGroupsConfig")
    )
    for key in EXTRA_MEMBERS:
        if key in cluster.extra:
            out[key] = cluster.extra[key]
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


def _dns_name(node: Node, region: str) -> str:
    domain = "ec2.internal" if region == "us-east-1" else f"{region}.compute.internal"
    return f"ip-{node.private_ip.replace('.', '-')}.{domain}"


def _s3_tier(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The agent's S3 tier as its last heartbeat reported it (checked by hyperpod_sim/domain/agents.py)."""
    if status is None:
        return None
    return {
        "PendingSteps": status.get("pending_steps"),
        "LagSeconds": status.get("lag_seconds"),
        "PersistedStepsTotal": status.get("persisted_steps_total"),
        "FailuresTotal": status.get("failures_total"),
        "LastPersistedSteps": status.get("last_persisted"),
        "LastError": status.get("last_error"),
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
    update: dict[str, Any] | None = None,
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
    spec = group.spec if group is not None else {}
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
    out["PrivatePrimaryIp"] = node.private_ip
    out["Placement"] = {
        "AvailabilityZone": f"{region}a",
        "AvailabilityZoneId": members.availability_zone_id(region),
    }
    return out


def _deletion(result: NodeDeletion, ids_key: str, failed_key: str, id_member: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if result.successful:
        out[ids_key] = result.successful
    if result.failed:
        out[failed_key] = [
            {"Code": code, "Message": message, id_member: node_id} for node_id, code, message in result.failed
        ]
    return out


# ---------------------------------------------------------------------- handlers


def create_cluster(svc: ClusterService, p: Params) -> dict[str, Any]:
    cluster = svc.create_cluster(
        name=p["ClusterName"],
        instance_groups=members.storable(p.get("InstanceGroups")),
        restricted_instance_groups=members.storable(p.get("RestrictedInstanceGroups")),
        vpc_config=p.get("VpcConfig"),
        tags=p.get("Tags"),
        orchestrator=p.get("Orchestrator"),
        node_recovery=p.get("NodeRecovery"),
        tiered_storage=p.get("TieredStorageConfig"),
        extra=_extra(p),
    )
    return {"ClusterArn": cluster.arn}


def _extra(p: Params) -> dict[str, Any]:
    """Cluster members stored as given: EXTRA_MEMBERS, and RestrictedInstanceGroupsConfig
    (returned mapped, by members.restricted_config)."""
    return {k: p[k] for k in (*EXTRA_MEMBERS, "RestrictedInstanceGroupsConfig") if k in p}


def update_cluster(svc: ClusterService, p: Params) -> dict[str, Any]:
    cluster = svc.update_cluster(
        name=p["ClusterName"],
        instance_groups=members.storable(p.get("InstanceGroups")),
        restricted_instance_groups=members.storable(p.get("RestrictedInstanceGroups")),
        instance_groups_to_delete=p.get("InstanceGroupsToDelete"),
        tiered_storage=p.get("TieredStorageConfig"),
        node_recovery=p.get("NodeRecovery"),
        orchestrator=p.get("Orchestrator"),
        extra=_extra(p),
    )
    return {"ClusterArn": cluster.arn}


def describe_cluster(svc: ClusterService, p: Params) -> dict[str, Any]:
    cluster, running = svc.describe_cluster(name=p["ClusterName"])
    flexible = any("InstanceRequirements" in g.spec for g in cluster.instance_groups)
    by_type = cluster_reads.running_by_type(svc.db, cluster_id=cluster.id) if flexible else {}
    return _cluster_description(cluster, running, by_type)


def delete_cluster(svc: ClusterService, p: Params) -> dict[str, Any]:
    return {"ClusterArn": svc.delete_cluster(name=p["ClusterName"]).arn}


def list_clusters(svc: ClusterService, p: Params) -> dict[str, Any]:
    page = svc.list_clusters(
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
            {g.spec["TrainingPlanArn"] for g in cluster.instance_groups if "TrainingPlanArn" in g.spec}
        )
        if plans:
            summary["TrainingPlanArns"] = plans
        summaries.append(summary)
    return {"ClusterSummaries": summaries, "NextToken": page.next_token}


def list_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    page = svc.list_cluster_nodes(
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
    region = svc.config.region
    cluster, _ = svc.describe_cluster(name=p["ClusterName"])
    specs = {g.name: g.spec for g in cluster.instance_groups}
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


def describe_cluster_node(svc: ClusterService, p: Params) -> dict[str, Any]:
    node = svc.describe_cluster_node(
        name=p["ClusterName"], node_id=p.get("NodeId"), node_logical_id=p.get("NodeLogicalId")
    )
    cluster, _ = svc.describe_cluster(name=p["ClusterName"])
    return {"NodeDetails": _node_details(node, cluster, svc.config.region)}


def batch_delete_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    by_id, by_logical = svc.batch_delete_cluster_nodes(
        name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
    )
    return {
        **_deletion(by_id, "Successful", "Failed", "NodeId"),
        **_deletion(by_logical, "SuccessfulNodeLogicalIds", "FailedNodeLogicalIds", "NodeLogicalId"),
    }


# ---------------------------------------------------------------------- node operations (nodeops)


def _node_operations(svc: ClusterService) -> NodeOperations:
    return NodeOperations(db=svc.db, clock=svc.clock, ids=svc.ids, on_change=svc.on_change)


def _node_results(by_id: NodeResults, by_logical: NodeResults) -> dict[str, Any]:
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


def batch_reboot_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    return _node_results(
        *_node_operations(svc).batch_reboot(
            name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
        )
    )


def batch_replace_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    return _node_results(
        *_node_operations(svc).batch_replace(
            name=p["ClusterName"], node_ids=p.get("NodeIds"), node_logical_ids=p.get("NodeLogicalIds")
        )
    )


def update_cluster_software(svc: ClusterService, p: Params) -> dict[str, Any]:
    service = SoftwareUpdateService(db=svc.db, clock=svc.clock, ids=svc.ids, on_change=svc.on_change)
    cluster = service.update_cluster_software(
        name=p["ClusterName"],
        instance_groups=p.get("InstanceGroups"),
        deployment_config=p.get("DeploymentConfig"),
        image_id=p.get("ImageId"),
    )
    return {"ClusterArn": cluster.arn}


def batch_add_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    service = AddNodesService(
        db=svc.db,
        clock=svc.clock,
        ids=svc.ids,
        region=svc.config.region,
        max_instances=svc.config.max_instances_per_cluster,
        on_change=svc.on_change,
    )
    result = service.batch_add(
        name=p["ClusterName"], nodes_to_add=p["NodesToAdd"], client_token=p.get("ClientToken")
    )
    return {"Successful": result.successful, "Failed": result.failed}


def start_cluster_health_check(svc: ClusterService, p: Params) -> dict[str, Any]:
    service = HealthCheckService(db=svc.db, clock=svc.clock, ids=svc.ids, on_change=svc.on_change)
    cluster = service.start(name=p["ClusterName"], configurations=p["DeepHealthCheckConfigurations"])
    return {"ClusterArn": cluster.arn}


def move_cluster_nodes(svc: ClusterService, p: Params) -> dict[str, Any]:
    """Successful / Failed (``Code``, ``NodeId``) for NodeIds and InstanceCount, their logical-id
    twins for NodeLogicalIds; an empty list is left out (the model's lists hold at least one)."""
    service = MoveNodesService(
        db=svc.db,
        clock=svc.clock,
        ids=svc.ids,
        max_instances=svc.config.max_instances_per_cluster,
        on_change=svc.on_change,
    )
    result = service.move(
        source_cluster_arn=p["SourceClusterArn"],
        source_group_name=p["SourceInstanceGroupName"],
        target_cluster_arn=p["TargetClusterArn"],
        target_group_name=p["TargetInstanceGroupName"],
        node_ids=p.get("NodeIds"),
        node_logical_ids=p.get("NodeLogicalIds"),
        instance_count=p.get("InstanceCount"),
        client_token=p.get("ClientToken"),
    )
    logical = result.by == "NodeLogicalIds"
    key = "NodeLogicalId" if logical else "NodeId"
    out: dict[str, Any] = {}
    if result.successful:
        out["SuccessfulNodeLogicalIds" if logical else "Successful"] = result.successful
    if result.failed:
        out["FailedNodeLogicalIds" if logical else "Failed"] = [
            {"Code": code, "Message": message, key: node} for node, code, message in result.failed
        ]
    return out


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


def list_cluster_events(svc: ClusterService, p: Params) -> dict[str, Any]:
    cluster, page = svc.list_cluster_events(
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


def describe_cluster_event(svc: ClusterService, p: Params) -> dict[str, Any]:
    cluster, event = svc.describe_cluster_event(name=p["ClusterName"], event_id=p["EventId"])
    described, _ = svc.describe_cluster(name=cluster.arn)
    node = None
    if event.instance_id is not None:
        node = cluster_reads.find_node(svc.db, cluster_id=cluster.id, node_id=event.instance_id)
    details = members.event_details(described, event, node, svc.config.region)
    return {"EventDetails": {**_event(cluster, event), "EventDetails": details}}


def add_tags(svc: ClusterService, p: Params) -> dict[str, Any]:
    return {"Tags": svc.add_tags(arn=p["ResourceArn"], tags=p["Tags"])}


def list_tags(svc: ClusterService, p: Params) -> dict[str, Any]:
    page = svc.list_tags(arn=p["ResourceArn"], max_results=p.get("MaxResults"), next_token=p.get("NextToken"))
    return {"Tags": [{"Key": t.key, "Value": t.value} for t in page.items], "NextToken": page.next_token}


def delete_tags(svc: ClusterService, p: Params) -> dict[str, Any]:
    svc.delete_tags(arn=p["ResourceArn"], keys=p["TagKeys"])
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
    # Node operations (nodeops: hyperpod_sim/domain/node_operations.py).
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


def dispatch(svc: ClusterService, operation: str, body: object) -> dict[str, Any]:
    """Validate ``body`` against the operation's input shape, run it, serialize the output."""
    handler = OPERATIONS.get(operation)
    if handler is None:
        raise UnknownOperationException(
            f"Operation {operation} is not supported by hyperpod-sim. Supported operations: "
            f"{', '.join(sorted(OPERATIONS))}."
        )
    params = shapes.validate_input(operation, body)
    return shapes.serialize_output(operation, handler(svc, params))
