"""UpdateClusterSoftware through boto3, on simulated nodes on the manual clock: batches, their
size, the wait between them, replica peers kept apart, statuses, image versions, validation (the
agents' side: tests/test_resilience_nodeops.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from hyperpod_sim.domain.node_operations.software_update import INITIAL_RELEASE, LATEST_RELEASE
from hyperpod_sim.models import Node
from tests.clusters import error_of, in_service
from tests.conftest import EKS, ControlPlane, group, wait_for
from tests.node_operations import nodes, status, statuses, two_clusters, where

TIERED = {
    "Orchestrator": EKS,
    "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
}


def by_count(count: int, **extra: Any) -> dict[str, Any]:
    return {"RollingUpdatePolicy": {"MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": count}}, **extra}


def releases(cp: ControlPlane, name: str) -> dict[str, str | None]:
    with cp.services.db.read() as session:
        return {n.id: n.image_version for n in session.scalars(select(Node).where(Node.group_name == name))}


def ring_order(cp: ControlPlane) -> list[str]:
    with cp.services.db.read() as session:
        return [n.id for n in session.scalars(select(Node).order_by(Node.slot))]


def batches_seen(cp: ControlPlane, sm: Any, name: str) -> list[list[str]]:
    """Advance the clock until the update is over; the sets of nodes seen SystemUpdating together."""
    seen: list[list[str]] = []

    def over() -> bool:
        updating = sorted(n for n, status in statuses(sm, name).items() if status == "SystemUpdating")
        if updating and (not seen or seen[-1] != updating):
            seen.append(updating)
        if sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService":
            return True
        cp.advance(30)
        return False

    wait_for(over, timeout=60, what=f"the software update of {name}")
    return seen


def test_rolls_batch_by_batch(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "roll", group(count=4))
    sm.update_cluster_software(ClusterName="roll", DeploymentConfig=by_count(2))
    assert sm.describe_cluster(ClusterName="roll")["ClusterStatus"] == "SystemUpdating"
    seen = batches_seen(control_plane, sm, "roll")
    order = ring_order(control_plane)
    assert seen == [sorted(order[:2]), sorted(order[2:])]
    assert set(releases(control_plane, "workers").values()) == {LATEST_RELEASE}
    assert set(statuses(sm, "roll").values()) == {"Running"}
    events = [
        e["Description"] for e in sm.list_cluster_events(ClusterName="roll", ResourceType="Cluster")["Events"]
    ]
    # (Started at the time the cluster became InService: in event id order among those.)
    assert events[0] == "Software update finished: 2 batches updated."
    assert f"Software update started: workers to {LATEST_RELEASE}; 4 nodes in 2 batches." in events[1:3]
    node = order[0]
    texts = [e["Description"] for e in sm.list_cluster_events(ClusterName="roll", NodeId=node)["Events"]]
    assert f"Node {node} is Running on image release {LATEST_RELEASE}." in texts
    assert (
        f"Node {node} is updating to image release {LATEST_RELEASE} (batch 1 of 2): its agent stops (after "
        "persisting its unpersisted steps to S3), its shared memory is cleared, and it starts again with the "
        "same node id."
    ) in texts


def test_percentage_batches_and_the_wait_between_them(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "pct", group(count=4))
    policy = {"MaximumBatchSize": {"Type": "CAPACITY_PERCENTAGE", "Value": 50}}
    sm.update_cluster_software(
        ClusterName="pct",
        InstanceGroups=[{"InstanceGroupName": "workers", "ImageReleaseVersion": "2.3.4"}],
        DeploymentConfig={"RollingUpdatePolicy": policy, "WaitIntervalInSeconds": 600},
    )
    order = ring_order(control_plane)
    first = wait_for(
        lambda: [n for n, s in statuses(sm, "pct").items() if s == "SystemUpdating"] or None,
        timeout=10,
        what="the first batch",
    )
    assert sorted(first) == sorted(order[:2])
    control_plane.advance(60)  # the first batch is back ...
    wait_for(lambda: releases(control_plane, "workers")[order[0]] == "2.3.4", timeout=10, what="batch 1 done")
    control_plane.advance(300)  # ... and the second waits out the 600 s interval
    assert set(statuses(sm, "pct").values()) == {"Running"}
    assert sm.describe_cluster(ClusterName="pct")["ClusterStatus"] == "SystemUpdating"
    control_plane.advance(300)
    wait_for(
        lambda: (
            sorted(n for n, s in statuses(sm, "pct").items() if s == "SystemUpdating") == sorted(order[2:])
        ),
        timeout=10,
        what="the second batch",
    )
    batches_seen(control_plane, sm, "pct")
    assert set(releases(control_plane, "workers").values()) == {"2.3.4"}


def test_replica_peers_are_never_in_one_batch(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "ring", group(count=4), **TIERED)
    assert set(releases(control_plane, "workers").values()) == {None}  # INITIAL_RELEASE
    sm.update_cluster_software(ClusterName="ring", DeploymentConfig=by_count(2))
    a, b, c, d = ring_order(control_plane)
    # Each node's peer is the next in the ring: a-b, b-c, c-d, d-a are never together.
    assert batches_seen(control_plane, sm, "ring") == [sorted([a, c]), sorted([b, d])]


def test_two_peers_without_a_deployment_config_go_one_at_a_time(control_plane: ControlPlane, sm: Any) -> None:
    """Without a DeploymentConfig every node would be in one batch; two replica peers are not."""
    in_service(control_plane, sm, "pair", group(count=2), **TIERED)
    sm.update_cluster_software(
        ClusterName="pair",
        DeploymentConfig={
            "RollingUpdatePolicy": {"MaximumBatchSize": {"Type": "INSTANCE_COUNT", "Value": 2}},
            "AutoRollbackConfiguration": [{"AlarmName": "loss-spike"}],
        },
    )
    a, b = ring_order(control_plane)
    assert batches_seen(control_plane, sm, "pair") == [[a], [b]]
    events = [
        e["Description"] for e in sm.list_cluster_events(ClusterName="pair", ResourceType="Cluster")["Events"]
    ]
    assert (
        f"Software update started: workers to {LATEST_RELEASE}; 2 nodes in 2 batches; rollback alarms "
        "loss-spike are not monitored (no CloudWatch here)."
    ) in events
    assert INITIAL_RELEASE != LATEST_RELEASE


def test_validation(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "v", group(count=1))
    assert error_of(
        sm.update_cluster_software, ClusterName="v", InstanceGroups=[{"InstanceGroupName": "nope"}]
    ) == (
        "ValidationException",
        "Instance group 'nope' does not exist in cluster 'v'; its groups are workers.",
    )
    assert error_of(sm.update_cluster_software, ClusterName="gone") == (
        "ResourceNotFound",
        "Cluster 'gone' does not exist.",
    )
    code, message = error_of(
        sm.update_cluster_software,
        ClusterName="v",
        InstanceGroups=[{"InstanceGroupName": "workers", "ImageReleaseVersion": "latest"}],
    )
    assert code == "ValidationException"
    assert "pattern" in message, message
    sm.update_cluster_software(ClusterName="v")
    assert error_of(sm.update_cluster_software, ClusterName="v") == (
        "ConflictException",
        "Cluster 'v' is SystemUpdating; UpdateClusterSoftware is accepted only while the cluster is "
        "InService.",
    )
    # While it rolls, the cluster takes no other change, and its nodes no reboot.
    assert (
        error_of(sm.update_cluster, ClusterName="v", InstanceGroups=[group(count=2)])[0]
        == "ConflictException"
    )
    (node,) = statuses(sm, "v")
    (failed,) = sm.batch_reboot_cluster_nodes(ClusterName="v", NodeIds=[node])["Failed"]
    assert failed["ErrorCode"] == "InvalidInstanceStatus"
    batches_seen(control_plane, sm, "v")


def test_image_versions_show_the_update_under_way_and_after(control_plane: ControlPlane, sm: Any) -> None:
    """What DescribeCluster and the nodes say about the release: the update's target as desired
    (UpdateAvailable) while it runs, with its deployment config; the new release as current after."""
    in_service(control_plane, sm, "shown", group(count=2, ImageReleaseVersion=INITIAL_RELEASE))
    sm.update_cluster_software(ClusterName="shown", DeploymentConfig=by_count(1, WaitIntervalInSeconds=30))
    (workers,) = sm.describe_cluster(ClusterName="shown")["InstanceGroups"]
    assert workers["CurrentImageReleaseVersion"] == INITIAL_RELEASE
    assert workers["DesiredImageReleaseVersion"] == LATEST_RELEASE
    assert workers["ImageVersionStatus"] == "UpdateAvailable"
    assert workers["SoftwareUpdateStatus"] == "InProgress"
    assert workers["ActiveSoftwareUpdateConfig"] == by_count(1, WaitIntervalInSeconds=30)
    batches_seen(control_plane, sm, "shown")
    (workers,) = sm.describe_cluster(ClusterName="shown")["InstanceGroups"]
    assert (workers["CurrentImageReleaseVersion"], workers["DesiredImageReleaseVersion"]) == (
        LATEST_RELEASE,
        LATEST_RELEASE,
    )
    assert workers["ImageVersionStatus"] == "UpToDate"
    assert workers["SoftwareUpdateStatus"] == "Succeeded"
    assert "ActiveSoftwareUpdateConfig" not in workers
    for node_id in statuses(sm, "shown"):
        details = sm.describe_cluster_node(ClusterName="shown", NodeId=node_id)["NodeDetails"]
        assert details["CurrentImageReleaseVersion"] == LATEST_RELEASE
        assert "LastSoftwareUpdateTime" in details


def test_the_last_update_status_stays_until_the_next_update(control_plane: ControlPlane, sm: Any) -> None:
    """SoftwareUpdateStatus is the group's last update's: absent before any, Succeeded once one is
    done, kept through UpdateCluster, InProgress again when an update names the group, and left
    alone by an update of other groups."""
    in_service(control_plane, sm, "last", group("a", count=1), group("b", count=1))

    def update_status() -> dict[str, str | None]:
        groups = sm.describe_cluster(ClusterName="last")["InstanceGroups"]
        return {g["InstanceGroupName"]: g.get("SoftwareUpdateStatus") for g in groups}

    assert update_status() == {"a": None, "b": None}
    sm.update_cluster_software(ClusterName="last", InstanceGroups=[{"InstanceGroupName": "a"}])
    assert update_status() == {"a": "InProgress", "b": None}
    batches_seen(control_plane, sm, "last")
    assert update_status() == {"a": "Succeeded", "b": None}
    sm.update_cluster(ClusterName="last", InstanceGroups=[group("a", count=2)])
    control_plane.settle(sm, "last")
    assert update_status() == {"a": "Succeeded", "b": None}
    sm.update_cluster_software(ClusterName="last", InstanceGroups=[{"InstanceGroupName": "b"}])
    assert update_status() == {"a": "Succeeded", "b": "InProgress"}
    batches_seen(control_plane, sm, "last")
    sm.update_cluster_software(ClusterName="last")
    assert update_status() == {"a": "InProgress", "b": "InProgress"}
    batches_seen(control_plane, sm, "last")
    assert update_status() == {"a": "Succeeded", "b": "Succeeded"}


def test_an_update_cluster_that_names_no_release_keeps_the_group_on_its_release(
    control_plane: ControlPlane, sm: Any
) -> None:
    """UpdateCluster re-sends a group's specification to scale it; without ImageReleaseVersion in it
    the group stays on the release its last software update put it on, and its new nodes get it."""
    in_service(control_plane, sm, "kept", group(count=1, ImageReleaseVersion=INITIAL_RELEASE))
    sm.update_cluster_software(ClusterName="kept")
    batches_seen(control_plane, sm, "kept")
    sm.update_cluster(ClusterName="kept", InstanceGroups=[group(count=2)])
    control_plane.settle(sm, "kept")
    (workers,) = sm.describe_cluster(ClusterName="kept")["InstanceGroups"]
    assert workers["CurrentImageReleaseVersion"] == LATEST_RELEASE
    assert workers["ImageVersionStatus"] == "UpToDate"
    for node_id in statuses(sm, "kept"):
        details = sm.describe_cluster_node(ClusterName="kept", NodeId=node_id)["NodeDetails"]
        assert details["CurrentImageReleaseVersion"] == LATEST_RELEASE


def test_a_node_moved_in_during_the_update_is_updated_once_it_runs(
    control_plane: ControlPlane, sm: Any
) -> None:
    """A node still AttachInProgress (MoveClusterNodes) when its batch starts is not left on the old
    release: once it runs it is updated in one more batch, and the update ends after it."""
    two_clusters(control_plane, sm)
    moved = sorted(n for n, s in nodes(sm, "src").items() if s["InstanceGroupName"] == "workers")[0]
    sm.move_cluster_nodes(**where(sm), NodeIds=[moved])

    def attaching() -> bool:
        # In steps well under the launch delay (60 s), so that it is seen before it runs.
        if moved in statuses(sm, "dst"):
            return True
        control_plane.advance(20)
        return False

    wait_for(attaching, timeout=30, what=f"{moved} in dst")
    assert status(sm, "dst", moved) == "AttachInProgress"
    sm.update_cluster_software(ClusterName="dst")
    seen = batches_seen(control_plane, sm, "dst")
    (first,) = (n for n in statuses(sm, "dst") if n != moved)
    assert seen == [[first], [moved]]
    for node_id in statuses(sm, "dst"):
        details = sm.describe_cluster_node(ClusterName="dst", NodeId=node_id)["NodeDetails"]
        assert (details["InstanceStatus"]["Status"], details["CurrentImageReleaseVersion"]) == (
            "Running",
            LATEST_RELEASE,
        )
    events = [
        e["Description"] for e in sm.list_cluster_events(ClusterName="dst", ResourceType="Cluster")["Events"]
    ]
    assert events[0] == "Software update finished: 2 batches updated."
    assert (
        f"Software update: 1 nodes that were not Running when their batch started, or joined during the "
        f"update, still run the old release ({moved}); they are updated in 1 more batches."
    ) in events
