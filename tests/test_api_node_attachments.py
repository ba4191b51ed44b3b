"""Attach/DetachClusterNodeVolume and AttachClusterNodeNetworkInterface through boto3 over real
HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import select

from hyperpod_sim.models import NodeAttachment
from tests.clusters import error_of
from tests.conftest import EKS, ROLE, ControlPlane, group, wait_for

VOLUME = "vol-0123456789abcdef0"
OTHER = "vol-0123456789abcdef1"
ENI = "eni-0123456789abcdef0"


def in_service(cp: ControlPlane, sm: Any, name: str = "c", **kwargs: Any) -> tuple[str, list[str]]:
    arn: str = sm.create_cluster(ClusterName=name, InstanceGroups=[group()], **kwargs)["ClusterArn"]
    cp.settle(sm, name)
    nodes = [n["InstanceId"] for n in sm.list_cluster_nodes(ClusterName=name)["ClusterNodeSummaries"]]
    return arn, nodes


def test_volumes(control_plane: ControlPlane, sm: Any) -> None:
    arn, (node, other) = in_service(control_plane, sm, Orchestrator=EKS)
    attached = sm.attach_cluster_node_volume(ClusterArn=arn, NodeId=node, VolumeId=VOLUME)
    del attached["ResponseMetadata"]
    attach_time = attached.pop("AttachTime")
    assert attached == {
        "ClusterArn": arn,
        "NodeId": node,
        "VolumeId": VOLUME,
        "Status": "attached",
        "DeviceName": "/dev/xvdb",
    }
    second = sm.attach_cluster_node_volume(ClusterArn=arn, NodeId=node, VolumeId=OTHER)
    assert second["DeviceName"] == "/dev/xvdc"
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=arn, NodeId=other, VolumeId=VOLUME) == (
        "ValidationException",
        f"Volume '{VOLUME}' is already attached; it must be available.",
    )
    assert error_of(sm.detach_cluster_node_volume, ClusterArn=arn, NodeId=other, VolumeId=VOLUME) == (
        "ResourceNotFound",
        f"Volume '{VOLUME}' is not attached to node '{other}'.",
    )
    detached = sm.detach_cluster_node_volume(ClusterArn=arn, NodeId=node, VolumeId=VOLUME)
    assert (detached["Status"], detached["AttachTime"], detached["DeviceName"]) == (
        "detached",
        attach_time,
        "/dev/xvdb",
    )
    # Available again: another node may take it, and gets the first free device name.
    assert (
        sm.attach_cluster_node_volume(ClusterArn=arn, NodeId=other, VolumeId=VOLUME)["DeviceName"]
        == "/dev/xvdb"
    )

    # A deleted node's attachments go with it.
    sm.batch_delete_cluster_nodes(ClusterName="c", NodeIds=[other])

    def released() -> bool:
        control_plane.advance(1)
        with control_plane.services.db.read() as session:
            held = session.scalars(select(NodeAttachment.resource_id)).all()
        return set(held) == {OTHER}

    wait_for(released, what="the deleted node's volume to be released")


def test_volume_rules(control_plane: ControlPlane, sm: Any) -> None:
    plain, (node, _) = in_service(control_plane, sm, "plain")
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=plain, NodeId=node, VolumeId=VOLUME) == (
        "ValidationException",
        "Cluster 'plain' is not orchestrated by EKS; volumes can be attached to nodes of EKS-orchestrated "
        "clusters only.",
    )
    missing = plain[:-12] + "zzzzzzzzzzzz"
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=missing, NodeId=node, VolumeId=VOLUME) == (
        "ResourceNotFound",
        f"Cluster '{missing}' does not exist.",
    )
    arn = sm.create_cluster(
        ClusterName="eks",
        InstanceGroups=[group()],
        RestrictedInstanceGroups=[
            {
                "InstanceGroupName": "rig",
                "InstanceType": "ml.p5.48xlarge",
                "InstanceCount": 1,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
    )["ClusterArn"]
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=arn, NodeId=node, VolumeId=VOLUME) == (
        "ValidationException",
        "Cluster 'eks' is Creating; it must be InService.",
    )
    control_plane.settle(sm, "eks")
    nodes = sm.list_cluster_nodes(ClusterName="eks")["ClusterNodeSummaries"]
    restricted = next(n["InstanceId"] for n in nodes if n["InstanceGroupName"] == "rig")
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=arn, NodeId=restricted, VolumeId=VOLUME) == (
        "ValidationException",
        f"Node '{restricted}' is in restricted instance group 'rig'; nothing can be attached to it.",
    )
    assert error_of(sm.attach_cluster_node_volume, ClusterArn=arn, NodeId=node, VolumeId=VOLUME) == (
        "ResourceNotFound",
        f"Node '{node}' does not exist in cluster 'eks'.",
    )


def test_network_interfaces(control_plane: ControlPlane, sm: Any) -> None:
    arn, (node, other) = in_service(control_plane, sm)
    attached = sm.attach_cluster_node_network_interface(ClusterName="c", NodeId=node, NetworkInterfaceId=ENI)
    assert (attached["ClusterArn"], attached["NodeId"], attached["NetworkInterfaceId"]) == (arn, node, ENI)
    assert attached["AttachmentId"].startswith("eni-attach-")
    assert len(attached["AttachmentId"]) == len("eni-attach-") + 17
    assert error_of(
        sm.attach_cluster_node_network_interface, ClusterName=arn, NodeId=other, NetworkInterfaceId=ENI
    ) == ("ValidationException", f"Network interface '{ENI}' is already attached.")


def test_rest_routes(control_plane: ControlPlane, sm: Any) -> None:
    arn, (node, _) = in_service(control_plane, sm, Orchestrator=EKS)
    eni = httpx.post(
        f"{control_plane.url}/clusters/c/nodes/{node}/network-interfaces", json={"NetworkInterfaceId": ENI}
    ).json()
    assert eni["NetworkInterfaceId"] == ENI
    body = {"ClusterArn": arn, "NodeId": node, "VolumeId": VOLUME}
    assert (
        httpx.post(f"{control_plane.url}/cluster-node-volumes/attach", json=body).json()["Status"]
        == "attached"
    )
    assert (
        httpx.post(f"{control_plane.url}/cluster-node-volumes/detach", json=body).json()["Status"]
        == "detached"
    )
