"""Handlers of Attach/DetachClusterNodeVolume and AttachClusterNodeNetworkInterface
(domain/nodes/attachments.py)."""

from __future__ import annotations

from typing import Any

from hyperpod_sim.api.deps import Params, Services
from hyperpod_sim.models import Cluster, NodeAttachment


def _volume(cluster: Cluster, attachment: NodeAttachment, status: str) -> dict[str, Any]:
    return {
        "ClusterArn": cluster.arn,
        "NodeId": attachment.node_id,
        "VolumeId": attachment.resource_id,
        "AttachTime": attachment.attach_time,
        "Status": status,
        "DeviceName": attachment.device_name,
    }


def attach_cluster_node_volume(services: Services, p: Params) -> dict[str, Any]:
    cluster, attachment = services.attachments.attach_volume(
        cluster_arn=p["ClusterArn"], node_id=p["NodeId"], volume_id=p["VolumeId"]
    )
    return _volume(cluster, attachment, "attached")


def detach_cluster_node_volume(services: Services, p: Params) -> dict[str, Any]:
    cluster, attachment = services.attachments.detach_volume(
        cluster_arn=p["ClusterArn"], node_id=p["NodeId"], volume_id=p["VolumeId"]
    )
    return _volume(cluster, attachment, "detached")


def attach_cluster_node_network_interface(services: Services, p: Params) -> dict[str, Any]:
    cluster, attachment = services.attachments.attach_network_interface(
        name=p["ClusterName"], node_id=p["NodeId"], network_interface_id=p["NetworkInterfaceId"]
    )
    return {
        "ClusterArn": cluster.arn,
        "NodeId": attachment.node_id,
        "NetworkInterfaceId": attachment.resource_id,
        "AttachmentId": attachment.id,
    }
