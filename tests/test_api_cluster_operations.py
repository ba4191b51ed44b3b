"""DescribeClusterOperation and ListClusterOperations through boto3 over real HTTP, and the
OperationId of events (ListClusterEvents' filter), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import select

from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.models import Cluster, ClusterOperation
from tests.clusters import error_of
from tests.conftest import ControlPlane, group, wait_for

UUID = "0123abcd-4567-89ab-cdef-0123456789ab"


def operations_of(sm: Any, name: str, **filters: Any) -> list[dict[str, Any]]:
    summaries: list[dict[str, Any]] = sm.list_cluster_operations(ClusterName=name, **filters)[
        "ClusterOperationSummaries"
    ]
    return summaries


def test_create_update_and_batch_delete_record_scaling_operations(
    control_plane: ControlPlane, sm: Any
) -> None:
    arn = sm.create_cluster(ClusterName="c", InstanceGroups=[group("workers", 2, MinInstanceCount=1)])[
        "ClusterArn"
    ]
    [created] = operations_of(sm, "c")
    assert created["ClusterArn"] == arn
    assert (created["Type"], created["Status"]) == ("Scaling", "InProgress")
    described = sm.describe_cluster_operation(ClusterName="c", OperationId=created["OperationId"])
    assert described["ScalingDetails"] == [
        {
            "InstanceGroupName": "workers",
            "Status": "InProgress",
            "Original": {"CurrentCount": 0, "TargetCount": 0, "MinCount": 1},
            "Desired": {"TargetCount": 2, "MinCount": 1},
        }
    ]
    assert sm.describe_cluster(ClusterName="c")["InstanceGroups"][0]["ActiveOperations"] == {"Scaling": 1}

    control_plane.settle(sm, "c")
    done = sm.describe_cluster_operation(ClusterName="c", OperationId=created["OperationId"])
    assert done["Status"] == "Done"
    assert done["ScalingDetails"][0]["Status"] == "Done"
    assert "ActiveOperations" not in sm.describe_cluster(ClusterName="c")["InstanceGroups"][0]

    # Every event of the creation carries its operation id; ListClusterEvents filters by it.
    events = sm.list_cluster_events(ClusterName="c", OperationId=created["OperationId"])["Events"]
    assert events
    assert all(e["OperationId"] == created["OperationId"] for e in events)
    assert {e["ResourceType"] for e in events} == {"Cluster", "Instance"}
    first = events[-1]
    detail = sm.describe_cluster_event(ClusterName="c", EventId=first["EventId"])["EventDetails"]
    assert detail["OperationId"] == created["OperationId"]

    sm.update_cluster(ClusterName="c", InstanceGroups=[group("workers", 3, MinInstanceCount=1)])
    updated = operations_of(sm, "c")[0]  # newest first
    assert updated["OperationId"] != created["OperationId"]
    scaling = sm.describe_cluster_operation(ClusterName="c", OperationId=updated["OperationId"])[
        "ScalingDetails"
    ]
    assert scaling[0]["Original"] == {"CurrentCount": 2, "TargetCount": 2, "MinCount": 1}
    assert scaling[0]["Desired"] == {"TargetCount": 3, "MinCount": 1}
    control_plane.settle(sm, "c")

    node = sm.list_cluster_nodes(ClusterName="c")["ClusterNodeSummaries"][0]["InstanceId"]
    sm.batch_delete_cluster_nodes(ClusterName="c", NodeIds=[node])
    deletion = operations_of(sm, "c")[0]
    assert deletion["Status"] in ("InProgress", "Done")  # Done once the reconciler removed the node
    described = sm.describe_cluster_operation(ClusterName="c", OperationId=deletion["OperationId"])
    assert described["ScalingDetails"][0]["Desired"]["TargetCount"] == 2
    [deleted_event] = sm.list_cluster_events(ClusterName="c", OperationId=deletion["OperationId"])["Events"][
        -1:
    ]
    assert deleted_event["InstanceId"] == node

    def finished() -> bool:
        control_plane.advance(1)
        status = sm.describe_cluster_operation(ClusterName="c", OperationId=deletion["OperationId"])["Status"]
        return bool(status == "Done")

    wait_for(finished, what="the batch deletion's operation to be Done")
    assert [o["Status"] for o in operations_of(sm, "c")] == ["Done", "Done", "Done"]


def test_filters_sorting_and_paging(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    control_plane.settle(sm, "c")
    control_plane.advance(10)
    sm.update_cluster(ClusterName="c", InstanceGroups=[group(count=3)])
    newest_first = operations_of(sm, "c")
    assert [o["Status"] for o in newest_first] == ["InProgress", "Done"]
    assert operations_of(sm, "c", SortOrder="Ascending", SortBy="CreationTime") == newest_first[::-1]
    assert operations_of(sm, "c", Status="Done") == newest_first[1:]
    assert operations_of(sm, "c", Type="DeepHealthCheck") == []
    after = newest_first[1]["CreationTime"]
    assert operations_of(sm, "c", CreationTimeAfter=after) == newest_first[:1]
    assert operations_of(sm, "c", CreationTimeBefore=newest_first[0]["CreationTime"]) == newest_first[1:]
    page = sm.list_cluster_operations(ClusterName="c", MaxResults=1)
    assert page["ClusterOperationSummaries"] == newest_first[:1]
    rest = sm.list_cluster_operations(ClusterName="c", MaxResults=1, NextToken=page["NextToken"])
    assert rest["ClusterOperationSummaries"] == newest_first[1:]
    assert "NextToken" not in rest


def test_superseded_by_a_newer_operation(control_plane: ControlPlane, sm: Any) -> None:
    """The node operations' way in (domain/operation_records.py), here without a reconciler racing it."""
    sm.create_cluster(ClusterName="c", InstanceGroups=[group(count=3)])
    control_plane.settle(sm, "c")
    services = control_plane.services
    with services.db.write() as session:
        cluster = session.scalars(select(Cluster).where(Cluster.name == "c")).one()
        node_ids = [n.id for n in cluster.nodes]
        now = control_plane.clock.now()
        first = operations.start_operation(
            session,
            ids=services.clusters.ids,
            now=now,
            cluster=cluster,
            type=operations.OperationType.REBOOT,
            requested_by="BatchRebootClusterNodes",
            node_ids=node_ids[:1],
        )
        second = operations.start_operation(
            session,
            ids=services.clusters.ids,
            now=now + timedelta(seconds=1),
            cluster=cluster,
            type=operations.OperationType.REBOOT,
            requested_by="BatchRebootClusterNodes",
            node_ids=node_ids[1:2],
        )
        first_id, second_id = first.id, second.id
    listed = {o["OperationId"]: o for o in operations_of(sm, "c")}
    assert (listed[first_id]["Status"], listed[second_id]["Status"]) == ("Superseded", "InProgress")
    assert listed[second_id]["Type"] == "Reboot"
    with services.db.write() as session:
        cluster = session.scalars(select(Cluster).where(Cluster.name == "c")).one()
        finished = operations.finish_operation(session, now=now, cluster=cluster)
        assert finished is not None
        assert finished.id == second_id
        assert cluster.operation_id is None
    assert sm.describe_cluster_operation(ClusterName="c", OperationId=second_id)["Status"] == "Done"


def test_errors(control_plane: ControlPlane, sm: Any) -> None:
    assert error_of(sm.describe_cluster_operation, ClusterName="nope", OperationId=UUID) == (
        "ResourceNotFound",
        "Cluster 'nope' does not exist.",
    )
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    assert error_of(sm.describe_cluster_operation, ClusterName="c", OperationId=UUID) == (
        "ResourceNotFound",
        f"Operation '{UUID}' does not exist in cluster 'c'.",
    )
    assert error_of(sm.list_cluster_operations, ClusterName="c", Status="Finished") == (
        "ValidationException",
        "1 validation error detected: Value 'Finished' at 'status' failed to satisfy constraint: "
        "Member must satisfy enum value set: [InProgress, Superseded, Done]",
    )


def test_delete_cluster_records_one_and_takes_the_records_with_it(
    control_plane: ControlPlane, sm: Any
) -> None:
    arn = sm.create_cluster(ClusterName="c", InstanceGroups=[group()])["ClusterArn"]
    control_plane.settle(sm, "c")
    reconciler = control_plane.services.reconciler
    reconciler.stop()  # the deletion would otherwise finish before it is looked at
    sm.delete_cluster(ClusterName="c")
    deletion = operations_of(sm, arn)[0]  # by ARN as well
    assert (deletion["Type"], deletion["Status"]) == ("Scaling", "InProgress")
    scaling = sm.describe_cluster_operation(ClusterName="c", OperationId=deletion["OperationId"])[
        "ScalingDetails"
    ]
    assert scaling[0]["Original"] == {"CurrentCount": 2, "TargetCount": 2}
    assert scaling[0]["Desired"] == {"TargetCount": 0}

    def gone() -> bool:
        control_plane.clock.advance(60)
        reconciler.run_once()
        try:
            sm.describe_cluster(ClusterName="c")
        except sm.exceptions.ResourceNotFound:
            return True
        return False

    wait_for(gone, what="cluster c to be deleted")
    with control_plane.services.db.read() as session:
        assert session.scalars(select(ClusterOperation)).all() == []


def test_rest_routes(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="c", InstanceGroups=[group()])
    listed = httpx.get(f"{control_plane.url}/clusters/c/operations", params={"MaxResults": 5}).json()
    [summary] = listed["ClusterOperationSummaries"]
    one = httpx.get(f"{control_plane.url}/clusters/c/operations/{summary['OperationId']}").json()
    assert one["Type"] == "Scaling"
    assert one["ScalingDetails"][0]["InstanceGroupName"] == "workers"
    missing = httpx.get(f"{control_plane.url}/clusters/c/operations/{UUID}")
    assert missing.status_code == 404
