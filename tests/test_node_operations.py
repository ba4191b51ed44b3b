"""BatchRebootClusterNodes and BatchReplaceClusterNodes through boto3, on simulated nodes (the
agents' side: tests/test_resilience_nodeops.py)."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests.clusters import error_of, in_service
from tests.conftest import ControlPlane, group
from tests.node_operations import MISSING, nodes, settle_nodes, statuses, texts

# ---------------------------------------------------------------------- reboot


def test_reboot_keeps_the_node_id_and_goes_through_pending(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "r", group(count=2))
    first, second = sorted(statuses(sm, "r"))
    answer = sm.batch_reboot_cluster_nodes(ClusterName="r", NodeIds=[first])
    assert answer["Successful"] == [first]
    assert answer["Failed"] == []
    assert "SuccessfulNodeLogicalIds" not in answer
    # Pending until it is back (the model's instance statuses have no rebooting one); the cluster
    # stays InService, so waiters see nothing unusual.
    status = sm.describe_cluster_node(ClusterName="r", NodeId=first)["NodeDetails"]["InstanceStatus"]
    assert status["Status"] == "Pending"
    assert sm.describe_cluster(ClusterName="r")["ClusterStatus"] == "InService"
    assert settle_nodes(control_plane, sm, "r", 2) == {first: "Running", second: "Running"}
    # (Both at the same time on the manual clock: their order in the listing is the event ids'.)
    assert sorted(texts(sm, "r", first)[-2:]) == [
        f"Node {first} is rebooting (BatchRebootClusterNodes): its agent stops (after persisting its "
        "unpersisted steps to S3), its shared memory is cleared, and it starts again with the same node id.",
        f"Node {first} rebooted: it is Running again after the launch delay.",
    ]
    details = sm.describe_cluster_node(ClusterName="r", NodeId=first)["NodeDetails"]
    assert "Message" not in details["InstanceStatus"]


def test_reboot_failures_are_per_node(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "f", group(count=2))
    first, second = sorted(statuses(sm, "f"))
    answer = sm.batch_reboot_cluster_nodes(ClusterName="f", NodeIds=[first, MISSING, first, second])
    assert answer["Successful"] == [first, second]  # a repeated id counts once
    assert answer["Failed"] == [
        {
            "NodeId": MISSING,
            "ErrorCode": "InstanceIdNotFound",
            "Message": f"Node {MISSING} is not part of cluster 'f'.",
        }
    ]
    # Asked again before it is back: refused (InstanceIdInUse while the reboot is under way,
    # InvalidInstanceStatus once its node is Pending for the launch delay).
    (again,) = sm.batch_reboot_cluster_nodes(ClusterName="f", NodeIds=[first])["Failed"]
    assert again["ErrorCode"] in ("InstanceIdInUse", "InvalidInstanceStatus"), again


def test_reboot_needs_an_in_service_cluster(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "u", group(count=1))
    (node,) = statuses(sm, "u")
    sm.update_cluster(ClusterName="u", InstanceGroups=[group(count=2)])
    answer = sm.batch_replace_cluster_nodes(ClusterName="u", NodeIds=[node])
    assert answer["Failed"] == [
        {
            "NodeId": node,
            "ErrorCode": "InvalidInstanceStatus",
            "Message": "Cluster 'u' is Updating; nodes can be replaced only while it is InService.",
        }
    ]


def test_validation(control_plane: ControlPlane, sm: Any, raw_sm: Any) -> None:
    in_service(control_plane, sm, "v", group(count=1))
    (node,) = statuses(sm, "v")
    for call in (raw_sm.batch_reboot_cluster_nodes, raw_sm.batch_replace_cluster_nodes):
        assert error_of(call, ClusterName="v") == (
            "ValidationException",
            "Specify NodeIds or NodeLogicalIds (or both).",
        )
        code, message = error_of(call, ClusterName="v", NodeIds=[f"i-{n:017x}" for n in range(26)])
        assert code == "ValidationException"
        assert "Member must have length less than or equal to 25" in message
        assert error_of(call, ClusterName="nope", NodeIds=[node]) == (
            "ResourceNotFound",
            "Cluster 'nope' does not exist.",
        )
        # Logical ids only with NodeProvisioningMode: Continuous (the model says so).
        logical = nodes(sm, "v")[node]["NodeLogicalId"]
        assert error_of(call, ClusterName="v", NodeLogicalIds=[logical]) == (
            "ValidationException",
            "NodeLogicalIds are supported only for clusters whose NodeProvisioningMode is Continuous; "
            "cluster 'v' is not: use NodeIds.",
        )


def test_logical_ids_on_a_continuous_cluster(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "c", group(count=2), NodeProvisioningMode="Continuous")
    listed = nodes(sm, "c")
    first, second = sorted(listed)
    logical = listed[second]["NodeLogicalId"]
    answer = sm.batch_reboot_cluster_nodes(
        ClusterName="c",
        NodeIds=[first],
        NodeLogicalIds=[logical, "workers-missing", listed[first]["NodeLogicalId"]],
    )
    assert answer["Successful"] == [first]
    assert answer["SuccessfulNodeLogicalIds"] == [logical]
    assert answer["FailedNodeLogicalIds"] == [
        {
            "NodeLogicalId": "workers-missing",
            "ErrorCode": "InstanceIdNotFound",
            "Message": "Node workers-missing is not part of cluster 'c'.",
        },
        {
            "NodeLogicalId": listed[first]["NodeLogicalId"],
            "ErrorCode": "InstanceIdInUse",
            "Message": f"Node {first} has an operation in progress (Reboot); wait for it to complete "
            "before retrying.",
        },
    ]
    assert settle_nodes(control_plane, sm, "c", 2) == {first: "Running", second: "Running"}


# ---------------------------------------------------------------------- replace


def test_replace_gives_a_new_node_in_the_same_group(control_plane: ControlPlane, sm: Any) -> None:
    in_service(control_plane, sm, "p", group(count=2))
    first, second = sorted(statuses(sm, "p"))
    answer = sm.batch_replace_cluster_nodes(ClusterName="p", NodeIds=[first])
    assert answer == {"Successful": [first], "Failed": [], "ResponseMetadata": answer["ResponseMetadata"]}
    current = settle_nodes(control_plane, sm, "p", 2)
    (replacement,) = set(current) - {second}
    assert replacement != first  # a new instance, a new instance id
    assert sm.describe_cluster(ClusterName="p")["InstanceGroups"][0]["TargetCount"] == 2
    assert texts(sm, "p", first)[-1] == (
        f"Node {first} is being replaced (BatchReplaceClusterNodes): it shuts down (its agent persists "
        "its unpersisted steps to S3 first) and a new instance on fresh hardware, with a new node id, takes "
        "its slot in group workers; its memory and volumes are gone."
    )
    assert texts(sm, "p", replacement) == [f"Node {replacement} launched in group workers."]
    with pytest.raises(ClientError):
        sm.describe_cluster_node(ClusterName="p", NodeId=first)
    gone = sm.batch_replace_cluster_nodes(ClusterName="p", NodeIds=[first])
    assert gone["Failed"][0]["ErrorCode"] == "InstanceIdNotFound"


def test_a_node_named_twice_is_replaced_once(control_plane: ControlPlane, sm: Any) -> None:
    """By id and by logical id in one request: the second finds it ShuttingDown."""
    in_service(control_plane, sm, "t", group(count=1), NodeProvisioningMode="Continuous")
    ((node, summary),) = nodes(sm, "t").items()
    logical = summary["NodeLogicalId"]
    answer = sm.batch_replace_cluster_nodes(ClusterName="t", NodeIds=[node], NodeLogicalIds=[logical])
    assert answer["Successful"] == [node]
    assert "SuccessfulNodeLogicalIds" not in answer  # none: the model's list holds at least one
    assert answer["FailedNodeLogicalIds"] == [
        {
            "NodeLogicalId": logical,
            "ErrorCode": "InvalidInstanceStatus",
            "Message": f"Node {node} is ShuttingDown; only a Running or Failure node can be replaced.",
        }
    ]
