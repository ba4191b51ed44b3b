"""The node operations in DescribeClusterOperation / ListClusterOperations: each request that acts
on nodes records one operation over those nodes, in progress until its work is done."""

from __future__ import annotations

from typing import Any

from tests.clusters import in_service
from tests.conftest import ControlPlane, group, wait_for
from tests.node_operations import settle_nodes, statuses


def newest(sm: Any, name: str) -> dict[str, Any]:
    summaries = sm.list_cluster_operations(ClusterName=name)["ClusterOperationSummaries"]
    latest = max(summaries, key=lambda s: s["CreationTime"])
    described: dict[str, Any] = sm.describe_cluster_operation(
        ClusterName=name, OperationId=latest["OperationId"]
    )
    return described


def done(cp: ControlPlane, sm: Any, name: str, operation_id: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cp.advance(60)
        described: dict[str, Any] = sm.describe_cluster_operation(ClusterName=name, OperationId=operation_id)
        return described if described["Status"] == "Done" else None

    result: dict[str, Any] = wait_for(check, timeout=30, what=f"operation {operation_id} Done")
    return result


def test_a_reboot_is_an_operation_until_its_node_is_back(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "rec", group(count=2))
    first, _ = sorted(statuses(sm, "rec"))
    sm.batch_reboot_cluster_nodes(ClusterName="rec", NodeIds=[first, "i-0123456789abcdef0"])
    operation = newest(sm, "rec")
    assert (operation["Type"], operation["Status"]) == ("Reboot", "InProgress")
    assert statuses(sm, "rec")[first] == "Pending"
    settle_nodes(control_plane, sm, "rec", 2)
    done(control_plane, sm, "rec", operation["OperationId"])
    # The reboot's own events carry its id.
    events = sm.list_cluster_events(ClusterName="rec", OperationId=operation["OperationId"])["Events"]
    assert any(first in e["Description"] for e in events)


def test_a_replace_and_a_health_check_are_recorded_with_their_types(
    control_plane: ControlPlane, sm: Any
) -> None:
    in_service(control_plane, sm, "rec2", group(count=2))
    first, _ = sorted(statuses(sm, "rec2"))
    sm.batch_replace_cluster_nodes(ClusterName="rec2", NodeIds=[first])
    replace = newest(sm, "rec2")
    assert (replace["Type"], replace["Status"]) == ("Replace", "InProgress")
    done(control_plane, sm, "rec2", replace["OperationId"])
    assert first not in statuses(sm, "rec2")  # gone, and its replacement runs
    sm.start_cluster_health_check(
        ClusterName="rec2",
        DeepHealthCheckConfigurations=[
            {"InstanceGroupName": "workers", "DeepHealthChecks": ["InstanceStress"]}
        ],
    )
    check = newest(sm, "rec2")
    assert (check["Type"], check["Status"]) == ("DeepHealthCheck", "InProgress")
    (details,) = check["DeepHealthCheckDetails"]
    assert details["InstanceGroupName"] == "workers"
    assert sorted(details["InstanceIds"]) == sorted(statuses(sm, "rec2"))
    done(control_plane, sm, "rec2", check["OperationId"])


def test_nodes_added_in_continuous_provisioning_are_a_scaling_operation(
    control_plane: ControlPlane, sm: Any
) -> None:
    in_service(control_plane, sm, "rec3", group(count=1), NodeProvisioningMode="Continuous")
    before = {
        s["OperationId"] for s in sm.list_cluster_operations(ClusterName="rec3")["ClusterOperationSummaries"]
    }
    sm.batch_add_cluster_nodes(
        ClusterName="rec3", NodesToAdd=[{"InstanceGroupName": "workers", "IncrementTargetCountBy": 2}]
    )
    added = newest(sm, "rec3")
    assert added["OperationId"] not in before
    assert added["Type"] == "Scaling"
    (details,) = added["ScalingDetails"]
    assert details["InstanceGroupName"] == "workers"
    assert (details["Original"]["CurrentCount"], details["Original"]["TargetCount"]) == (1, 1)
    assert details["Desired"]["TargetCount"] == 3
    # The addition's event carries the operation's id (ListClusterEvents' OperationId).
    events = sm.list_cluster_events(ClusterName="rec3", OperationId=added["OperationId"])["Events"]
    assert [e["Description"] for e in events if "BatchAddClusterNodes" in e["Description"]] == [
        "2 nodes added to group workers (BatchAddClusterNodes); its target count is 3."
    ]
    settle_nodes(control_plane, sm, "rec3", 3)
    finished = done(control_plane, sm, "rec3", added["OperationId"])
    assert finished["ScalingDetails"][0]["Status"] == "Done"
    assert set(statuses(sm, "rec3").values()) == {"Running"}
