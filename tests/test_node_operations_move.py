"""MoveClusterNodes through boto3, on simulated nodes (the agents' side:
tests/test_resilience_nodeops.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.clusters import error_of, in_service
from tests.conftest import EKS, ControlPlane, group, wait_for
from tests.node_operations import (
    CONTINUOUS,
    MISSING,
    arn,
    arrive,
    nodes,
    status,
    statuses,
    texts,
    two_clusters,
    where,
    workers,
)


def counts(sm: Any, name: str) -> dict[str, tuple[int, int]]:
    """(CurrentCount, TargetCount) per group."""
    return {
        g["InstanceGroupName"]: (g["CurrentCount"], g["TargetCount"])
        for g in sm.describe_cluster(ClusterName=name)["InstanceGroups"]
    }


def settle_in(cp: ControlPlane, sm: Any, node_id: str, name: str = "dst") -> None:
    def running() -> bool:
        cp.advance(60)
        return statuses(sm, name).get(node_id) == "Running"

    wait_for(running, timeout=30, what=f"{node_id} Running in {name}")


# ---------------------------------------------------------------------- happy paths


def test_move_by_node_ids_detaches_then_attaches_with_the_same_ids(
    control_plane: ControlPlane, sm: Any
) -> None:
    two_clusters(control_plane, sm)
    moved = workers(sm, "src")[0]
    logical = nodes(sm, "src")[moved]["NodeLogicalId"]
    answer = sm.move_cluster_nodes(**where(sm), NodeIds=[moved])
    assert answer["Successful"] == [moved]
    assert "Failed" not in answer
    assert "SuccessfulNodeLogicalIds" not in answer
    # In the source cluster while it detaches; the source group's counts leave it out at once.
    assert status(sm, "src", moved) == "DetachInProgress"
    assert counts(sm, "src")["workers"] == (2, 2)
    assert counts(sm, "dst")["workers"] == (1, 1)
    arrive(control_plane, sm, moved)
    assert moved not in statuses(sm, "src")
    # (AttachInProgress until it runs, for the launch delay on this manual clock: the events below.)
    details = sm.describe_cluster_node(ClusterName="dst", NodeId=moved)["NodeDetails"]
    assert details["NodeLogicalId"] == logical  # the same instance, the same logical id
    assert details["InstanceGroupName"] == "workers"
    assert counts(sm, "dst")["workers"][1] == 2
    settle_in(control_plane, sm, moved)
    assert counts(sm, "dst")["workers"] == (2, 2)
    assert counts(sm, "src")["workers"] == (2, 2)
    assert (
        "Message"
        not in sm.describe_cluster_node(ClusterName="dst", NodeId=moved)["NodeDetails"]["InstanceStatus"]
    )
    # Events in both clusters.
    assert texts(sm, "src", moved)[-2:] == [
        f"Node {moved} is moving to group workers of cluster 'dst' (MoveClusterNodes): it leaves this "
        "cluster's replica ring, its agent stops (after persisting its unpersisted steps to S3), and its "
        "shared memory and volumes are cleared.",
        f"Node {moved} detached from group workers (MoveClusterNodes): its agent stopped and its shared "
        f"memory was cleared; it is now a node of group workers of cluster 'dst'.",
    ]
    assert texts(sm, "dst", moved) == [
        f"Node {moved} is attaching to group workers from group workers of cluster 'src' (MoveClusterNodes): "
        "same instance id and logical id, new root and secondary volumes; its agent starts as a member of "
        "this cluster, with its policy.",
        f"Node {moved} is Running in group workers (MoveClusterNodes).",
    ]
    group_events = sm.list_cluster_events(ClusterName="dst", ResourceType="InstanceGroup")["Events"]
    assert group_events[0]["Description"] == (
        "1 nodes are moving into group workers from group workers of cluster 'src' (MoveClusterNodes): "
        f"{moved}."
    )
    # An operation record in each, Done: the source's once the node left, the target's once it runs.
    for name in ("src", "dst"):
        (record,) = [
            o
            for o in sm.list_cluster_operations(ClusterName=name)["ClusterOperationSummaries"]
            if o["Type"] == "Move"
        ]
        assert record["Status"] == "Done", (name, record)


def test_move_by_logical_ids_within_one_cluster(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "src", group("workers", 2), group("spare", 1), **CONTINUOUS)
    listed = nodes(sm, "src")
    moved = sorted(n for n, s in listed.items() if s["InstanceGroupName"] == "workers")[0]
    logical = listed[moved]["NodeLogicalId"]
    answer = sm.move_cluster_nodes(
        **where(sm, target="src", target_group="spare"), NodeLogicalIds=[logical, "workers-missing"]
    )
    assert answer["SuccessfulNodeLogicalIds"] == [logical]
    assert answer["FailedNodeLogicalIds"] == [
        {
            "NodeLogicalId": "workers-missing",
            "Code": "NodeIdNotFound",
            "Message": "Node workers-missing is not part of instance group 'workers' of cluster 'src'.",
        }
    ]
    assert "Successful" not in answer
    settle_in(control_plane, sm, moved, "src")
    details = sm.describe_cluster_node(ClusterName="src", NodeLogicalId=logical)["NodeDetails"]
    assert (details["InstanceId"], details["InstanceGroupName"]) == (moved, "spare")
    assert counts(sm, "src") == {"workers": (1, 1), "spare": (2, 2)}


def test_move_by_instance_count_picks_the_newest_eligible(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    before = workers(sm, "src")
    answer = sm.move_cluster_nodes(**where(sm), InstanceCount=2)
    assert len(answer["Successful"]) == 2
    assert set(answer["Successful"]) <= set(before)
    assert "Failed" not in answer
    for moved in answer["Successful"]:
        arrive(control_plane, sm, moved)
        settle_in(control_plane, sm, moved)
    assert counts(sm, "src")["workers"] == (1, 1)
    assert counts(sm, "dst")["workers"] == (3, 3)
    # More than are eligible: the request fails and nothing moves.
    assert error_of(sm.move_cluster_nodes, **where(sm), InstanceCount=2) == (
        "ValidationException",
        "InstanceCount asks for 2 nodes, but instance group 'workers' of cluster 'src' has 1 that can be "
        "moved now (Running, of an instance type the target group 'workers' runs, no operation in progress, "
        "no EBS volume attached); no node was moved.",
    )
    assert counts(sm, "src")["workers"] == (1, 1)


def test_client_token_answers_the_first_answer(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    first, second = workers(sm, "src")[:2]
    answer = sm.move_cluster_nodes(**where(sm), NodeIds=[first, MISSING], ClientToken="move-1")
    again = sm.move_cluster_nodes(**where(sm), NodeIds=[first, MISSING], ClientToken="move-1")
    assert again["Successful"] == answer["Successful"] == [first]
    assert again["Failed"] == answer["Failed"]
    # Nothing new started: one move record, one node detaching.
    records = sm.list_cluster_operations(ClusterName="src")["ClusterOperationSummaries"]
    assert [o["Type"] for o in records].count("Move") == 1
    assert counts(sm, "src")["workers"] == (2, 2)
    assert error_of(sm.move_cluster_nodes, **where(sm), NodeIds=[second], ClientToken="move-1") == (
        "ValidationException",
        "ClientToken 'move-1' was used with different parameters.",
    )
    assert status(sm, "src", second) == "Running"
    # After 8 hours the token is free again (the node it names moved meanwhile: NodeIdNotFound).
    control_plane.advance(8 * 3600 + 1)
    arrive(control_plane, sm, first)
    assert error_of(sm.move_cluster_nodes, **where(sm), NodeIds=[first], ClientToken="move-1")[1] == (
        f"None of the nodes can be moved, so none was: {first}: NodeIdNotFound (Node {first} is not part of "
        "instance group 'workers' of cluster 'src'.)"
    )


# ---------------------------------------------------------------------- refusals


def test_partial_failure(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    first, second, third = workers(sm, "src")
    small = next(n for n, s in nodes(sm, "src").items() if s["InstanceGroupName"] == "small")
    sm.batch_reboot_cluster_nodes(ClusterName="src", NodeIds=[second])
    answer = sm.move_cluster_nodes(**where(sm), NodeIds=[first, second, MISSING, small])
    assert answer["Successful"] == [first]
    busy, *others = answer["Failed"]
    # (Pending from its reboot, or still to be taken up by the reconciler: refused either way.)
    assert (busy["NodeId"], busy["Code"]) in ((second, "NodeIdInUse"), (second, "InvalidNodeStatus")), busy
    assert others == [
        {
            "NodeId": MISSING,
            "Code": "NodeIdNotFound",
            "Message": f"Node {MISSING} is not part of instance group 'workers' of cluster 'src'.",
        },
        {
            "NodeId": small,
            "Code": "NodeIdNotFound",
            "Message": f"Node {small} is not part of instance group 'workers' of cluster 'src'.",
        },
    ]
    # The one that moves, moves; the others stay.
    arrive(control_plane, sm, first)
    assert status(sm, "src", third) == "Running"
    # Asked again while it attaches: not in the source group any more.
    (again,) = sm.move_cluster_nodes(**where(sm), NodeIds=[first, third])["Failed"]
    assert again["Code"] == "NodeIdNotFound"


def test_none_can_move_and_instance_types_must_match(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    small = next(n for n, s in nodes(sm, "src").items() if s["InstanceGroupName"] == "small")
    assert error_of(sm.move_cluster_nodes, **where(sm, source_group="small"), NodeIds=[small]) == (
        "ValidationException",
        f"None of the nodes can be moved, so none was: {small}: NodeInstanceTypeMismatch (Node {small} is a "
        "ml.g5.xlarge; instance group 'workers' of cluster 'dst' runs ml.p5.48xlarge.)",
    )
    assert status(sm, "src", small) == "Running"
    assert counts(sm, "src")["small"] == (1, 1)


def test_the_source_group_keeps_its_minimum(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm, minimum=2)
    first, second, _ = workers(sm, "src")
    assert error_of(sm.move_cluster_nodes, **where(sm), NodeIds=[first, second]) == (
        "ValidationException",
        "Moving 2 nodes would take instance group 'workers' of cluster 'src' to 1 nodes, below its minimum "
        "instance count (2); no node was moved.",
    )
    assert statuses(sm, "src")[first] == statuses(sm, "src")[second] == "Running"
    assert sm.move_cluster_nodes(**where(sm), NodeIds=[first])["Successful"] == [first]


def test_validation(control_plane: ControlPlane, sm: Any, raw_sm: Any) -> None:
    two_clusters(control_plane, sm)
    in_service(control_plane, sm, "plain", group("workers", 1), Orchestrator=EKS)
    in_service(control_plane, sm, "noeks", group("workers", 1), NodeProvisioningMode="Continuous")
    node = workers(sm, "src")[0]
    call = raw_sm.move_cluster_nodes
    assert error_of(call, **where(sm)) == (
        "ValidationException",
        "Specify exactly one of NodeIds, NodeLogicalIds or InstanceCount.",
    )
    assert error_of(call, **where(sm), NodeIds=[node], InstanceCount=1) == (
        "ValidationException",
        "Specify exactly one of NodeIds, NodeLogicalIds or InstanceCount; the request names NodeIds and "
        "InstanceCount.",
    )
    code, message = error_of(call, **where(sm), InstanceCount=51)
    assert code == "ValidationException"
    assert "Member must have value less than or equal to 50" in message
    code, message = error_of(call, **where(sm), NodeIds=[f"i-{n:017x}" for n in range(51)])
    assert "Member must have length less than or equal to 50" in message
    missing = arn(sm, "src")[:-12] + "000000000000"
    assert error_of(call, **{**where(sm), "TargetClusterArn": missing}, NodeIds=[node]) == (
        "ResourceNotFound",
        f"Cluster '{missing}' does not exist.",
    )
    assert error_of(call, **where(sm, target_group="nope"), NodeIds=[node]) == (
        "ResourceNotFound",
        "Instance group 'nope' does not exist in cluster 'dst'.",
    )
    assert error_of(call, **where(sm, target="src"), NodeIds=[node]) == (
        "ValidationException",
        "The target instance group 'workers' is the source instance group; within one cluster, nodes can be "
        "moved only to another instance group.",
    )
    assert error_of(call, **where(sm, target="plain"), NodeIds=[node]) == (
        "ValidationException",
        "MoveClusterNodes is supported only for clusters whose NodeProvisioningMode is Continuous; cluster "
        "'plain' is not.",
    )
    assert error_of(call, **where(sm, target="noeks"), NodeIds=[node]) == (
        "ValidationException",
        "Cluster 'noeks' is not orchestrated by EKS; MoveClusterNodes moves nodes between EKS-orchestrated "
        "clusters only.",
    )
    sm.update_cluster(ClusterName="dst", InstanceGroups=[group("workers", 2)])
    assert error_of(call, **where(sm), NodeIds=[node]) == (
        "ValidationException",
        "Cluster 'dst' is Updating; nodes can be moved only between clusters that are InService.",
    )
    assert status(sm, "src", node) == "Running"


def test_a_node_with_a_volume_attached_stays(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    node = workers(sm, "src")[0]
    sm.attach_cluster_node_volume(ClusterArn=arn(sm, "src"), NodeId=node, VolumeId="vol-0123456789abcdef0")
    (failed,) = sm.move_cluster_nodes(**where(sm), NodeIds=[node, workers(sm, "src")[1]])["Failed"]
    assert failed == {
        "NodeId": node,
        "Code": "InvalidNodeStatus",
        "Message": f"Node {node} has EBS volume vol-0123456789abcdef0 attached; detach it first "
        "(DetachClusterNodeVolume).",
    }


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_target_deleted_while_detaching_takes_the_node_back(control_plane: ControlPlane, sm: Any) -> None:
    two_clusters(control_plane, sm)
    node = workers(sm, "src")[0]
    sm.move_cluster_nodes(**where(sm), NodeIds=[node])
    sm.delete_cluster(ClusterName="dst")
    settle_in(control_plane, sm, node, "src")
    assert nodes(sm, "src")[node]["InstanceGroupName"] == "workers"
    assert counts(sm, "src")["workers"] == (3, 3)
