"""The output drift walk: every output member of every cluster operation in botocore's model is
returned, or listed as not applicable with its reason (hyperpod_sim/api/handlers/members.py NOT_RETURNED).

The input drift walk (tests/test_shapes.py) proves every input constraint is enforced; this one
proves no output member is forgotten. A scenario drives every served cluster operation through
boto3 with requests that use every input member that has an output counterpart, while a recorder
on the serializer notes each (structure, member) that went on the wire. The walk then goes down
each operation's output shape from the top, through members that were returned, and fails naming
``Shape.Member`` (with its path) for one that was neither returned nor listed. A botocore upgrade
that adds an output member fails here until it is returned or listed with a reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from hyperpod_sim.api import shapes
from hyperpod_sim.api.handlers import members
from hyperpod_sim.api.registry import OPERATIONS
from tests.conftest import EKS, ROLE, ControlPlane, group

# Cluster operations of the model this build does not serve yet, with who brings them (issue 15).
NOT_SERVED: dict[str, str] = {}

# Members returned only in a state this scenario does not reach, and where that is covered.
CONDITIONAL: dict[str, str] = {
    "DescribeClusterResponse.FailureMessage": "a Failed cluster (tests/test_services_reconciler.py)",
    "InstanceMetadata.FailureMessage": "the event of a node that is in Failure now",
    "EventMetadata.Cluster": "the event of a Failed cluster (its FailureMessage)",
    "EventMetadata.InstanceGroup": "an InstanceGroup event: nothing records one yet (members.event_details)",
}

CLUSTER_OPERATIONS = sorted(name for name in shapes.service_model().operation_names if "Cluster" in name)
SERVED = [name for name in CLUSTER_OPERATIONS if name in OPERATIONS]
TRAINING_PLAN = "arn:aws:sagemaker:us-east-1:123456789012:training-plan/my-plan-for-drift"
VPC = {"SecurityGroupIds": ["sg-0123456789abcdef0"], "Subnets": ["subnet-0123456789abcdef0"]}
DEPLOYMENT = {
    "RollingUpdatePolicy": {
        "MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": 1},
        "RollbackMaximumBatchSize": {"Type": "CAPACITY_PERCENTAGE", "Value": 50},
    },
    "WaitIntervalInSeconds": 60,
    "AutoRollbackConfiguration": [{"AlarmName": "gpu-alarm"}],
}
STORAGE = [
    {"EbsVolumeConfig": {"VolumeSizeInGB": 100, "VolumeKmsKeyId": "key-1", "RootVolume": False}},
    {
        "FsxLustreConfig": {
            "DnsName": "fs-0123456789abcdef0.fsx.aws.com",
            "MountName": "fsx1",
            "MountPath": "/fsx",
        }
    },
    {"FsxOpenZfsConfig": {"DnsName": "fs-0123456789abcdef1.fsx.aws.com", "MountPath": "/zfs"}},
]
LIFECYCLE = {"SourceS3Uri": "s3://bucket/lc", "OnCreate": "on_create.sh", "OnInitComplete": "done.sh"}


def eks_groups() -> list[dict[str, Any]]:
    common = {
        "LifeCycleConfig": LIFECYCLE,
        "ThreadsPerCore": 2,
        "InstanceStorageConfigs": STORAGE,
        "OnStartDeepHealthChecks": ["InstanceStress"],
        "OverrideVpcConfig": VPC,
        "ScheduledUpdateConfig": {
            "ScheduleExpression": "cron(0 4 ? * SUN *)",
            "DeploymentConfig": DEPLOYMENT,
        },
    }
    return [
        group(
            "workers",
            2,
            MinInstanceCount=1,
            TrainingPlanArn=TRAINING_PLAN,
            ImageId="ami-0123456789abcdef0",
            ImageReleaseVersion="2025.1.0",
            KubernetesConfig={
                "Labels": {"team": "ml"},
                "Taints": [{"Key": "nvidia.com/gpu", "Value": "present", "Effect": "NoSchedule"}],
            },
            CapacityRequirements={"Spot": {}},
            NetworkInterface={"InterfaceType": "efa"},
            AutoPatchConfig={
                "PatchingStrategy": "DrainFirst",
                "PatchSchedule": {"NextPatchDate": 1900000000},
                "DeploymentConfig": DEPLOYMENT,
                "IdleWaitWindowInSeconds": 3600,
                "DrainPolicy": {"DrainTimeoutInSeconds": 60, "OnDrainTimeout": "Force"},
            },
            **common,
        ),
        {
            "InstanceGroupName": "flex",
            "InstanceRequirements": {"InstanceTypes": ["ml.g5.xlarge", "ml.g5.2xlarge"]},
            "InstanceCount": 1,
            "ExecutionRole": ROLE,
            "ThreadsPerCore": 1,
            "CapacityRequirements": {"OnDemand": {}},
        },
    ]


def restricted_group() -> dict[str, Any]:
    return {
        "InstanceGroupName": "restricted",
        "InstanceType": "ml.p5.48xlarge",
        "InstanceCount": 1,
        "ExecutionRole": ROLE,
        "ThreadsPerCore": 1,
        "InstanceStorageConfigs": STORAGE,
        "OnStartDeepHealthChecks": ["InstanceConnectivity"],
        "TrainingPlanArn": TRAINING_PLAN,
        "OverrideVpcConfig": VPC,
        "ScheduledUpdateConfig": {
            "ScheduleExpression": "cron(0 4 ? * SUN *)",
            "DeploymentConfig": DEPLOYMENT,
        },
        "EnvironmentConfig": {
            "FSxLustreConfig": {"SizeInGiB": 1200, "PerUnitStorageThroughput": 125},
        },
    }


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """ "Shape.Member" of every structure member the serializer put on the wire."""
    recorded: set[str] = set()
    original = shapes._serialize

    def recording(shape: Any, value: Any, where: str) -> Any:
        if shape.type_name == "structure" and hasattr(value, "items"):
            recorded.update(f"{shape.name}.{key}" for key, item in value.items() if item is not None)
        return original(shape, value, where)

    monkeypatch.setattr(shapes, "_serialize", recording)
    return recorded


def drive(cp: ControlPlane, sm: Any) -> None:
    """Every served cluster operation, with inputs that reach every output member."""
    sm.create_cluster(
        ClusterName="eks",
        InstanceGroups=eks_groups(),
        RestrictedInstanceGroups=[restricted_group()],
        RestrictedInstanceGroupsConfig={
            "SharedEnvironmentConfig": {
                "FSxLustreConfig": {"SizeInGiB": 1200, "PerUnitStorageThroughput": 250},
                "FSxLustreDeletionPolicy": "Keep",
            }
        },
        VpcConfig=VPC,
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 30},
        NodeRecovery="Automatic",
        NodeProvisioningMode="Continuous",
        ClusterRole=ROLE,
        AutoScaling={"Mode": "Enable", "AutoScalerType": "Karpenter"},
    )
    sm.describe_cluster(ClusterName="eks")  # while Creating: ActiveOperations
    second_eks = sm.create_cluster(ClusterName="eks2", InstanceGroups=[group()], Orchestrator=EKS)[
        "ClusterArn"
    ]
    cp.settle(sm, "eks")
    sm.create_cluster(
        ClusterName="slurm",
        NodeProvisioningMode="Continuous",
        InstanceGroups=[group("ctl", 1, SlurmConfig={"NodeType": "Controller", "PartitionNames": ["dev"]})],
        Orchestrator={
            "Slurm": {
                "SlurmConfigStrategy": "Managed",
                "AccountingDatabase": {
                    "Endpoint": "db.example.com",
                    "Port": 3306,
                    "Name": "slurm_acct_db",
                    "SecretArn": "arn:aws:secretsmanager:us-east-1:123456789012:secret:db-AbCdEf",
                },
            }
        },
    )
    cp.settle(sm, "slurm")
    sm.update_cluster(
        ClusterName="slurm", InstanceGroups=[group("ctl", 1, SlurmConfig={"NodeType": "Controller"})]
    )
    sm.describe_cluster(ClusterName="slurm")
    sm.list_clusters(MaxResults=1)
    sm.list_clusters()
    sm.list_cluster_nodes(ClusterName="eks", MaxResults=1)
    sm.list_cluster_events(ClusterName="eks", MaxResults=1)
    nodes = sm.list_cluster_nodes(ClusterName="eks", IncludeNodeLogicalIds=True)["ClusterNodeSummaries"]
    worker = next(n for n in nodes if n["InstanceGroupName"] == "workers")
    sm.describe_cluster_node(ClusterName="eks", NodeId=worker["InstanceId"])
    events = sm.list_cluster_events(ClusterName="eks", SortBy="EventTime")["Events"]
    for kind in ("Cluster", "Instance"):  # nothing here records InstanceGroup events yet
        event = next(e for e in events if e["ResourceType"] == kind)
        sm.describe_cluster_event(ClusterName="eks", EventId=event["EventId"])
    arn = sm.describe_cluster(ClusterName="eks")["ClusterArn"]
    volume = {"ClusterArn": arn, "NodeId": worker["InstanceId"], "VolumeId": "vol-0123456789abcdef0"}
    sm.attach_cluster_node_volume(**volume)
    sm.detach_cluster_node_volume(**volume)
    sm.attach_cluster_node_network_interface(
        ClusterName="eks", NodeId=worker["InstanceId"], NetworkInterfaceId="eni-0123456789abcdef0"
    )
    sm.add_tags(ResourceArn=arn, Tags=[{"Key": "team", "Value": "ml"}])
    sm.list_tags(ResourceArn=arn)
    sm.delete_tags(ResourceArn=arn, TagKeys=["team"])
    other = next(n for n in nodes if n["InstanceId"] != worker["InstanceId"])
    sm.batch_delete_cluster_nodes(ClusterName="eks", NodeIds=[other["InstanceId"], "i-0123456789abcdef0"])
    sm.batch_delete_cluster_nodes(ClusterName="eks", NodeLogicalIds=[worker["NodeLogicalId"], "no-such-node"])
    sm.list_cluster_operations(ClusterName="eks", MaxResults=1)
    for operation in sm.list_cluster_operations(ClusterName="eks")["ClusterOperationSummaries"]:
        sm.describe_cluster_operation(ClusterName="eks", OperationId=operation["OperationId"])
    created = sm.create_cluster_scheduler_config(
        Name="policy",
        ClusterArn=arn,
        SchedulerConfig={
            "PriorityClasses": [{"Name": "training", "Weight": 50}],
            "FairShare": "Enabled",
            "IdleResourceSharing": "Enabled",
        },
        Description="first",
    )
    config_id = created["ClusterSchedulerConfigId"]
    sm.update_cluster_scheduler_config(
        ClusterSchedulerConfigId=config_id, TargetVersion=1, Description="second"
    )
    sm.describe_cluster_scheduler_config(ClusterSchedulerConfigId=config_id)
    sm.list_cluster_scheduler_configs(MaxResults=1)
    sm.create_cluster_scheduler_config(Name="other", ClusterArn=second_eks, SchedulerConfig={})
    sm.list_cluster_scheduler_configs(MaxResults=1)
    sm.delete_cluster_scheduler_config(ClusterSchedulerConfigId=config_id)
    slurm = sm.describe_cluster(ClusterName="slurm")["ClusterArn"]
    extension = sm.create_cluster_extension(
        ClusterArn=slurm, ExtensionName="sagemaker-observability", ConfigurationValues='{"a": 1}'
    )["ExtensionArn"]
    sm.update_cluster_extension(ClusterArn=slurm, ExtensionArn=extension, ExtensionVersion="1.1.0")
    sm.describe_cluster_extension(ClusterArn=slurm, ExtensionArn=extension)
    sm.list_cluster_extensions(ClusterArn=slurm, MaxResults=1)
    sm.list_cluster_extension_versions(ExtensionName="sagemaker-observability", MaxResults=1)
    sm.delete_cluster_extension(ClusterArn=slurm, ExtensionArn=extension)
    sm.delete_cluster(ClusterName="slurm")
    node_operations(cp, sm)


def node_operations(cp: ControlPlane, sm: Any) -> None:
    """The node operations (docs/node-operations.md), each on nodes of its own, with one id that
    does not exist so that both the successful and the failed lists are answered."""
    sm.create_cluster(
        ClusterName="ops",
        InstanceGroups=[group("workers", 4)],
        Orchestrator=EKS,
        NodeProvisioningMode="Continuous",
    )
    cp.settle(sm, "ops")
    sm.batch_add_cluster_nodes(
        ClusterName="ops",
        NodesToAdd=[
            {"InstanceGroupName": "workers", "IncrementTargetCountBy": 1},
            {
                "InstanceGroupName": "nope",
                "IncrementTargetCountBy": 1,
                "InstanceTypes": ["ml.g5.xlarge"],
                "AvailabilityZones": ["us-east-1a"],
            },
        ],
    )
    nodes = sm.list_cluster_nodes(ClusterName="ops", IncludeNodeLogicalIds=True)["ClusterNodeSummaries"]
    running = [n for n in nodes if n["InstanceStatus"]["Status"] == "Running"]
    missing_id, missing_logical = "i-0123456789abcdef0", "no-such-node"
    sm.batch_reboot_cluster_nodes(ClusterName="ops", NodeIds=[running[0]["InstanceId"], missing_id])
    sm.batch_reboot_cluster_nodes(
        ClusterName="ops", NodeLogicalIds=[running[1]["NodeLogicalId"], missing_logical]
    )
    sm.batch_replace_cluster_nodes(ClusterName="ops", NodeIds=[running[2]["InstanceId"], missing_id])
    sm.batch_replace_cluster_nodes(
        ClusterName="ops", NodeLogicalIds=[running[3]["NodeLogicalId"], missing_logical]
    )
    cp.settle(sm, "ops")
    sm.start_cluster_health_check(
        ClusterName="ops",
        DeepHealthCheckConfigurations=[
            {"InstanceGroupName": "workers", "DeepHealthChecks": ["InstanceStress"]}
        ],
    )
    # The clock has not moved: the nodes are DeepHealthCheckInProgress, with the checks as message.
    checking = sm.list_cluster_nodes(ClusterName="ops")["ClusterNodeSummaries"]
    sm.describe_cluster_node(ClusterName="ops", NodeId=checking[0]["InstanceId"])
    cp.settle(sm, "ops")
    sm.update_cluster_software(ClusterName="ops", DeploymentConfig=DEPLOYMENT)
    cp.settle(sm, "ops", "SystemUpdating")
    sm.describe_cluster(ClusterName="ops")  # SoftwareUpdateStatus, ActiveSoftwareUpdateConfig
    for node in sm.list_cluster_nodes(ClusterName="ops")["ClusterNodeSummaries"]:
        sm.describe_cluster_node(ClusterName="ops", NodeId=node["InstanceId"])
    cp.settle(sm, "ops")
    for node in sm.list_cluster_nodes(ClusterName="ops")["ClusterNodeSummaries"]:  # LastSoftwareUpdateTime
        sm.describe_cluster_node(ClusterName="ops", NodeId=node["InstanceId"])
    # MoveClusterNodes to another EKS cluster, by ids and by logical ids, one of each missing.
    target = sm.create_cluster(
        ClusterName="ops-target",
        InstanceGroups=[group("workers", 1)],
        Orchestrator=EKS,
        NodeProvisioningMode="Continuous",
    )["ClusterArn"]
    cp.settle(sm, "ops-target")
    source = sm.describe_cluster(ClusterName="ops")["ClusterArn"]
    nodes = sm.list_cluster_nodes(ClusterName="ops", IncludeNodeLogicalIds=True)["ClusterNodeSummaries"]
    where = {
        "SourceClusterArn": source,
        "SourceInstanceGroupName": "workers",
        "TargetClusterArn": target,
        "TargetInstanceGroupName": "workers",
    }
    sm.move_cluster_nodes(**where, NodeIds=[nodes[0]["InstanceId"], missing_id])
    sm.move_cluster_nodes(**where, NodeLogicalIds=[nodes[1]["NodeLogicalId"], missing_logical])


def missing_members(operation: str, seen: set[str]) -> tuple[list[str], set[str]]:
    """Output members of ``operation`` neither returned nor listed, and the listed ones reached."""
    missing: list[str] = []
    listed: set[str] = set()

    def walk(shape: Any, path: str, stack: tuple[str, ...]) -> None:
        kind = shape.type_name
        if kind == "structure":
            if shape.name in stack:
                return
            for name, member in shape.members.items():
                key = f"{shape.name}.{name}"
                if key in seen:
                    walk(member, f"{path}.{name}", (*stack, shape.name))
                elif key in members.NOT_RETURNED or key in CONDITIONAL:
                    listed.add(key)
                else:
                    missing.append(f"{key} (at {path}.{name})")
        elif kind == "list":
            walk(shape.member, f"{path}[]", stack)
        elif kind == "map":
            walk(shape.value, f"{path}{{}}", stack)

    output = shapes.service_model().operation_model(operation).output_shape
    if output is not None:
        walk(output, operation, ())
    return missing, listed


def model_members(operation: str) -> set[str]:
    """Every "Shape.Member" in ``operation``'s output tree."""
    found: set[str] = set()

    def walk(shape: Any) -> None:
        if shape.type_name == "structure":
            for name, member in shape.members.items():
                if f"{shape.name}.{name}" not in found:
                    found.add(f"{shape.name}.{name}")
                    walk(member)
        elif shape.type_name == "list":
            walk(shape.member)
        elif shape.type_name == "map":
            walk(shape.value)

    output = shapes.service_model().operation_model(operation).output_shape
    if output is not None:
        walk(output)
    return found


def test_every_cluster_operation_is_served_or_pending() -> None:
    unknown = sorted(set(CLUSTER_OPERATIONS) - set(OPERATIONS) - set(NOT_SERVED))
    assert not unknown, f"cluster operations of the model neither served nor listed in NOT_SERVED: {unknown}"
    stale = sorted(set(NOT_SERVED) & set(OPERATIONS))
    assert not stale, f"served now, remove from NOT_SERVED: {stale}"


def test_every_output_member_is_returned_or_not_applicable(
    control_plane: ControlPlane, sm: Any, seen: set[str]
) -> None:
    drive(control_plane, sm)
    missing: list[str] = []
    listed: set[str] = set()
    for operation in SERVED:
        found, reached = missing_members(operation, seen)
        missing.extend(f"{operation}: {member}" for member in found)
        listed |= reached
    assert not missing, "output members neither returned nor listed in members.NOT_RETURNED:\n" + "\n".join(
        missing
    )
    returned_anyway = sorted((set(members.NOT_RETURNED) | set(CONDITIONAL)) & seen)
    assert not returned_anyway, f"listed as not returned, but returned: {returned_anyway}"
    reachable = set().union(*(model_members(operation) for operation in SERVED))
    unreached = sorted((set(members.NOT_RETURNED) | set(CONDITIONAL)) - reachable)
    assert not unreached, f"listed members no served output has: {unreached}"


def test_every_reason_is_given() -> None:
    for key, reason in (members.NOT_RETURNED | CONDITIONAL).items():
        shape, member = key.split(".")
        assert member in shapes.service_model().shape_for(shape).members, key
        assert reason.strip(), key
