"""The output members issue 15 added, by value, through boto3 over real HTTP (their presence for
every operation is tests/test_output_drift.py's)."""

from __future__ import annotations

from typing import Any

from tests.conftest import EKS, ROLE, ControlPlane, group

SHARED = {
    "SharedEnvironmentConfig": {
        "FSxLustreConfig": {"SizeInGiB": 1200, "PerUnitStorageThroughput": 250},
        "FSxLustreDeletionPolicy": "Keep",
    }
}


def test_group_and_node_members(control_plane: ControlPlane, sm: Any) -> None:
    plan = "arn:aws:sagemaker:us-east-1:123456789012:training-plan/my-plan-for-members"
    sm.create_cluster(
        ClusterName="c",
        InstanceGroups=[
            group(
                "workers",
                2,
                ImageReleaseVersion="2025.1.0",
                TrainingPlanArn=plan,
                CapacityRequirements={"Spot": {}},
                NetworkInterface={"InterfaceType": "efa-only"},
                KubernetesConfig={"Labels": {"team": "ml"}},
                AutoPatchConfig={
                    "PatchingStrategy": "WhenIdle",
                    "PatchSchedule": {"NextPatchDate": 1900000000},
                },
            ),
            {
                "InstanceGroupName": "flex",
                "InstanceRequirements": {"InstanceTypes": ["ml.g5.xlarge", "ml.g5.2xlarge"]},
                "InstanceCount": 1,
                "ExecutionRole": ROLE,
            },
        ],
        Orchestrator=EKS,
    )
    creating = sm.describe_cluster(ClusterName="c")["InstanceGroups"][0]
    assert (creating["ActiveOperations"], creating["TargetStateCount"]) == ({"Scaling": 1}, 0)
    described = control_plane.settle(sm, "c")
    workers, flex = described["InstanceGroups"]
    assert workers["CurrentImageReleaseVersion"] == workers["DesiredImageReleaseVersion"] == "2025.1.0"
    assert workers["ImageVersionStatus"] == "UpToDate"
    assert workers["TargetStateCount"] == 2
    assert "ActiveOperations" not in workers
    assert workers["TrainingPlanStatus"] == "Active"
    assert workers["KubernetesConfig"] == {"CurrentLabels": {"team": "ml"}, "DesiredLabels": {"team": "ml"}}
    patch = workers["AutoPatchConfig"]
    assert patch["CurrentPatchSchedule"]["NextPatchDate"].timestamp() == 1900000000
    assert patch["DesiredPatchSchedule"] == patch["CurrentPatchSchedule"]
    assert "InstanceTypeDetails" not in workers  # only a flexible group has them
    assert flex["InstanceTypeDetails"] == [
        {"InstanceType": "ml.g5.xlarge", "CurrentCount": 1},
        {"InstanceType": "ml.g5.2xlarge", "CurrentCount": 0},
    ]
    assert sm.list_clusters()["ClusterSummaries"][0]["ImageVersionStatus"] == "UpToDate"

    nodes = sm.list_cluster_nodes(ClusterName="c")["ClusterNodeSummaries"]
    worker = next(n for n in nodes if n["InstanceGroupName"] == "workers")
    assert (worker["CurrentImageReleaseVersion"], worker["ImageVersionStatus"]) == ("2025.1.0", "UpToDate")
    details = sm.describe_cluster_node(ClusterName="c", NodeId=worker["InstanceId"])["NodeDetails"]
    assert details["CapacityType"] == "Spot"
    assert details["NetworkInterface"] == {"InterfaceType": "efa-only"}
    assert details["KubernetesConfig"] == {"CurrentLabels": {"team": "ml"}, "DesiredLabels": {"team": "ml"}}
    assert details["DesiredImageReleaseVersion"] == "2025.1.0"
    flex_node = next(n for n in nodes if n["InstanceGroupName"] == "flex")
    flex_details = sm.describe_cluster_node(ClusterName="c", NodeId=flex_node["InstanceId"])["NodeDetails"]
    assert flex_details["CapacityType"] == "OnDemand"
    assert "CurrentImageReleaseVersion" not in flex_details


def test_restricted_instance_groups_config(control_plane: ControlPlane, sm: Any) -> None:
    restricted = {
        "InstanceGroupName": "rig",
        "InstanceType": "ml.p5.48xlarge",
        "InstanceCount": 1,
        "ExecutionRole": ROLE,
    }
    sm.create_cluster(
        ClusterName="c",
        RestrictedInstanceGroups=[restricted],
        RestrictedInstanceGroupsConfig=SHARED,
        Orchestrator=EKS,
    )
    expected = {
        "SharedEnvironmentConfig": {
            "CurrentFSxLustreConfig": {"SizeInGiB": 1200, "PerUnitStorageThroughput": 250},
            "DesiredFSxLustreConfig": {"SizeInGiB": 1200, "PerUnitStorageThroughput": 250},
            "CurrentFSxLustreDeletionPolicy": "Keep",
            "DesiredFSxLustreDeletionPolicy": "Keep",
        }
    }
    assert control_plane.settle(sm, "c")["RestrictedInstanceGroupsConfig"] == expected
    bigger = {"SizeInGiB": 2400, "PerUnitStorageThroughput": 500}
    changed = {
        "SharedEnvironmentConfig": {"FSxLustreConfig": bigger, "FSxLustreDeletionPolicy": "DeleteIfNotUsed"}
    }
    sm.update_cluster(
        ClusterName="c", RestrictedInstanceGroups=[restricted], RestrictedInstanceGroupsConfig=changed
    )
    assert sm.describe_cluster(ClusterName="c")["RestrictedInstanceGroupsConfig"] == {
        "SharedEnvironmentConfig": {
            "CurrentFSxLustreConfig": bigger,
            "DesiredFSxLustreConfig": bigger,
            "CurrentFSxLustreDeletionPolicy": "DeleteIfNotUsed",
            "DesiredFSxLustreDeletionPolicy": "DeleteIfNotUsed",
        }
    }


def test_event_details(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group(count=1)])
    control_plane.settle(sm, "c")
    [node] = sm.list_cluster_nodes(ClusterName="c", IncludeNodeLogicalIds=True)["ClusterNodeSummaries"]
    events = sm.list_cluster_events(ClusterName="c", ResourceType="Instance", SortBy="EventTime")["Events"]
    detail = sm.describe_cluster_event(ClusterName="c", EventId=events[0]["EventId"])["EventDetails"]
    assert detail["EventDetails"] == {"EventMetadata": {"Instance": {"NodeLogicalId": node["NodeLogicalId"]}}}
    cluster_event = sm.list_cluster_events(ClusterName="c", ResourceType="Cluster")["Events"][0]
    plain = sm.describe_cluster_event(ClusterName="c", EventId=cluster_event["EventId"])["EventDetails"]
    assert "EventDetails" not in plain  # a cluster that has not failed has no metadata to give
