"""Output members derived from what a cluster stores (issue 15: every member returned that applies).

The handlers in api/registry.py call these to fill members whose value is not a stored input
echoed under its own name: renamed ones (``ImageReleaseVersion`` -> ``Current``/
``DesiredImageReleaseVersion``), ones that describe the simulator's state (``ImageVersionStatus``,
``ActiveOperations``) and the event metadata of DescribeClusterEvent. What the model defines and
hyperpod-sim does not return is listed, with the reason, in ``NOT_RETURNED``; the output drift
test (tests/test_output_drift.py) holds every output member of every cluster operation to one or
the other.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hyperpod_sim.domain.node_operations.software_update import release_of
from hyperpod_sim.models import Cluster, ClusterEvent, InstanceGroup, Node
from hyperpod_sim.models.software_update import SoftwareUpdate

# hyperpod-sim runs no AMIs and knows no newer release than the one a group asked for: every
# group and node is on the latest image it can have.
IMAGE_UP_TO_DATE = "UpToDate"
# A training plan's capacity is not reserved here; a group that names one runs as if it were.
TRAINING_PLAN_ACTIVE = "Active"
# Group statuses during which a scaling operation is in progress (ActiveOperations: Scaling).
_SCALING_STATUSES = frozenset({"Creating", "Updating"})

NOT_RETURNED: dict[str, str] = {
    # "Shape.Member": why hyperpod-sim does not return it.
    "ClusterNodeSummary.UltraServerInfo": "no UltraServer instance types are simulated",
    "ClusterNodeDetails.UltraServerInfo": "no UltraServer instance types are simulated",
    "ClusterNodeDetails.PrivatePrimaryIpv6": "simulated nodes have IPv4 loopback-range addresses only",
    "ClusterMetadata.EksRoleAccessEntries": "no EKS cluster is called; no access entries are created",
    "ClusterMetadata.SlrAccessEntry": "no EKS cluster is called; no access entries are created",
    "InstanceGroupMetadata.CapacityReservation": "no capacity reservations are simulated",
    "InstanceGroupMetadata.AmiOverride": "no AMIs are run",
    "EventMetadata.InstanceGroupScaling": "scaling events carry their counts in the description",
    "InstanceMetadata.CustomerEni": "no ENIs are created",
    "InstanceMetadata.AdditionalEnis": "no ENIs are created",
    "InstanceMetadata.InstanceRequirementsEniConfigurations": "no ENIs are created",
    "InstanceMetadata.CapacityReservation": "no capacity reservations are simulated",
    "InstanceMetadata.LcsExecutionState": "lifecycle scripts are not run",
    "EventMetadata.DatabaseConfiguration": "no Slurm accounting database is configured",
    "EventMetadata.SlurmHealth": "no Slurm daemons are run",
    "DescribeClusterOperationResponse.DeepHealthCheckDetails": (
        "only deep health check operations have them (StartClusterHealthCheck, not served yet)"
    ),
    "DescribeClusterSchedulerConfigResponse.FailureReason": "no scheduler is configured, so none fails",
    "DescribeClusterSchedulerConfigResponse.CreatedBy": (
        "a Studio user profile or IAM identity: requests here carry neither (access keys only)"
    ),
    "DescribeClusterSchedulerConfigResponse.LastModifiedBy": (
        "a Studio user profile or IAM identity: requests here carry neither (access keys only)"
    ),
    "ListClusterExtensionsResponse.NextToken": (
        "the catalog offers one extension and a cluster has at most one of a name: never a second page"
    ),
    "ExtensionHealthIssue.Code": "nothing is installed on the nodes, so no extension has a health issue",
    "ExtensionHealthIssue.Message": "nothing is installed on the nodes, so no extension has a health issue",
    "ExtensionHealthIssue.NodeCount": "nothing is installed on the nodes, so no extension has a health issue",
    "ClusterAutoScalingConfigOutput.FailureMessage": "no autoscaler is run, so none fails",
    "EnvironmentConfigDetails.S3OutputPath": (
        "the S3 location HyperPod chooses for a restricted group's output; none is made here"
    ),
}


def storable(value: Any) -> Any:
    """A validated input as the JSON columns store it: timestamps (datetimes once validated, as
    AutoPatchConfig.PatchSchedule.NextPatchDate) as epoch seconds, which output serialization
    passes through unchanged."""
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, dict):
        return {key: storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    return value


def image_release(current: str | None, desired: str | None = None) -> dict[str, Any]:
    """Current/DesiredImageReleaseVersion (the group's ``ImageReleaseVersion``, or what a software
    update installed; ``desired``: the version an UpdateClusterSoftware under way installs), with
    the ImageVersionStatus: UpdateAvailable while they differ."""
    desired = desired or current
    out: dict[str, Any] = {
        "ImageVersionStatus": IMAGE_UP_TO_DATE if desired == current else "UpdateAvailable"
    }
    if current is not None:
        out["CurrentImageReleaseVersion"] = current
    if desired is not None:
        out["DesiredImageReleaseVersion"] = desired
    return out


def updating_to(update: SoftwareUpdate | None, group_name: str) -> str | None:
    """The release the software update under way (``cluster.software_update``) installs on the
    group, or None."""
    return update.versions.get(group_name) if update is not None else None


def active_update_config(update: SoftwareUpdate) -> dict[str, Any]:
    """ActiveSoftwareUpdateConfig: the DeploymentConfig of the update under way, as it was given."""
    config: dict[str, Any] = {"WaitIntervalInSeconds": update.wait_interval_in_seconds}
    if update.maximum_batch_size is not None:
        config["RollingUpdatePolicy"] = {"MaximumBatchSize": update.maximum_batch_size.wire()}
    if update.alarms:
        config["AutoRollbackConfiguration"] = [{"AlarmName": alarm} for alarm in update.alarms]
    return config


def kubernetes_details(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The group's KubernetesConfig as Current/Desired labels and taints."""
    k8s = spec.get("KubernetesConfig")
    if k8s is None:
        return None
    return {
        key: k8s[src]
        for key, src in (
            ("CurrentLabels", "Labels"),
            ("DesiredLabels", "Labels"),
            ("CurrentTaints", "Taints"),
            ("DesiredTaints", "Taints"),
        )
        if src in k8s
    }


def auto_patch_details(spec: dict[str, Any]) -> dict[str, Any] | None:
    """AutoPatchConfig as DescribeCluster returns it: PatchSchedule as Current/DesiredPatchSchedule."""
    config = spec.get("AutoPatchConfig")
    if config is None:
        return None
    out = {key: value for key, value in config.items() if key != "PatchSchedule"}
    if "PatchSchedule" in config:
        out["CurrentPatchSchedule"] = out["DesiredPatchSchedule"] = config["PatchSchedule"]
    return out


def group_state(
    group: InstanceGroup, running: int, by_type: dict[str, int], update: SoftwareUpdate | None = None
) -> dict[str, Any]:
    """Members of ClusterInstanceGroupDetails that describe the group's state (``update``: the
    cluster's software update under way, if any; SoftwareUpdateStatus is the group's last one's)."""
    spec = group.spec.wire()
    target = updating_to(update, group.name)
    out: dict[str, Any] = {
        **image_release(spec.get("ImageReleaseVersion"), target),
        "TargetStateCount": running,
    }
    if group.software_update_status is not None:  # the last update's, until the next one
        out["SoftwareUpdateStatus"] = group.software_update_status
    if update is not None and target is not None:
        out["ActiveSoftwareUpdateConfig"] = active_update_config(update)
    if group.status in _SCALING_STATUSES:
        out["ActiveOperations"] = {"Scaling": 1}
    if "TrainingPlanArn" in spec:
        out["TrainingPlanStatus"] = TRAINING_PLAN_ACTIVE
    if "InstanceRequirements" in spec:
        out["InstanceTypeDetails"] = [
            {
                "InstanceType": instance_type,
                "CurrentCount": by_type.get(instance_type, 0),
                "ThreadsPerCore": spec.get("ThreadsPerCore"),
            }
            for instance_type in spec["InstanceRequirements"]["InstanceTypes"]
        ]
    return out


def capacity_type(spec: dict[str, Any]) -> str:
    """Spot when the group asked for Spot capacity, OnDemand otherwise (the default)."""
    return "Spot" if "Spot" in (spec.get("CapacityRequirements") or {}) else "OnDemand"


def node_state(
    spec: dict[str, Any], *, details: bool, node: Node | None = None, update: SoftwareUpdate | None = None
) -> dict[str, Any]:
    """Members of ClusterNodeSummary (``details``: ClusterNodeDetails) taken from the node's group
    and its software updates (``update``: the cluster's under way, if any)."""
    group_release = spec.get("ImageReleaseVersion")
    current = release_of(node, group_release) if node is not None else group_release
    release = image_release(current, updating_to(update, node.group_name) if node is not None else None)
    if node is not None and node.last_software_update is not None:
        release["LastSoftwareUpdateTime"] = node.last_software_update
    if not details:
        release.pop("DesiredImageReleaseVersion", None)
        return release
    out = {**release, "CapacityType": capacity_type(spec), "KubernetesConfig": kubernetes_details(spec)}
    if "NetworkInterface" in spec:
        out["NetworkInterface"] = spec["NetworkInterface"]
    return out


def restricted_config(stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """RestrictedInstanceGroupsConfig as DescribeCluster returns it (Current = Desired: the
    shared FSx for Lustre file system is not provisioned, so it never lags the request)."""
    if stored is None:
        return None
    shared = stored["SharedEnvironmentConfig"]
    out: dict[str, Any] = {}
    if "FSxLustreConfig" in shared:
        out["CurrentFSxLustreConfig"] = out["DesiredFSxLustreConfig"] = shared["FSxLustreConfig"]
    if "FSxLustreDeletionPolicy" in shared:
        policy = shared["FSxLustreDeletionPolicy"]
        out["CurrentFSxLustreDeletionPolicy"] = out["DesiredFSxLustreDeletionPolicy"] = policy
    return {"SharedEnvironmentConfig": out}


def event_details(
    cluster: Cluster, event: ClusterEvent, node: Node | None, region: str
) -> dict[str, Any] | None:
    """EventDetails of DescribeClusterEvent: the metadata of the event's resource, as it is now."""
    metadata: dict[str, Any] = {}
    if event.resource_type == "Cluster":
        if cluster.failure_message:
            metadata["Cluster"] = {"FailureMessage": cluster.failure_message}
    elif event.resource_type == "InstanceGroup":
        group = next((g for g in cluster.instance_groups if g.name == event.instance_group_name), None)
        vpc = (group.spec.override_vpc_config if group is not None else None) or cluster.vpc_config
        described: dict[str, Any] = {"AvailabilityZoneId": availability_zone_id(region)}
        if vpc:
            described["SubnetId"] = vpc["Subnets"][0]
            described["SecurityGroupIds"] = vpc["SecurityGroupIds"]
        if group is not None and group.status == "Failed":
            described["FailureMessage"] = cluster.failure_message
        metadata["InstanceGroup"] = described
    elif node is not None:
        instance: dict[str, Any] = {"NodeLogicalId": node.logical_id}
        if node.status == "Failure" and node.status_message:
            instance["FailureMessage"] = node.status_message
        metadata["Instance"] = instance
    return {"EventMetadata": metadata} if metadata else None


def availability_zone_id(region: str) -> str:
    """us-east-1 -> use1-az1: the AZ id shape AWS uses."""
    area, direction, number = region.split("-")
    return f"{area}{direction[0]}{number}-az1"
