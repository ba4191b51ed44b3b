"""EBS volumes and network interfaces attached to nodes (AttachClusterNodeVolume,
DetachClusterNodeVolume, AttachClusterNodeNetworkInterface).

hyperpod-sim has no EC2: a volume or an ENI is an id the caller names, and attaching it records
which node holds it (one node at a time), under which device name (``/dev/xvdb`` onwards for
volumes). Nothing is mounted or plugged in, so an attachment completes within the request: the
answer says ``attached`` (``detached``); a node is AttachInProgress/DetachInProgress only while
MoveClusterNodes moves it (domain/node_operations/move.py). An attachment goes with its node: a replaced node
is fresh hardware, without it; a moved node keeps its network interfaces (its volumes must be
detached first) (docs/cluster-operations.md).

Rules kept as documented: volumes on EKS-orchestrated clusters only, the cluster InService, the
node in the cluster and not in a restricted instance group; a volume must be attached to the node
it is detached from.
"""

from __future__ import annotations

import secrets
import string
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from hyperpod_sim.domain.clock import Clock
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.errors import ResourceNotFound, ValidationException
from hyperpod_sim.domain.lifecycle import ClusterStatus, NodeStatus
from hyperpod_sim.models import Cluster, Database, InstanceGroup, Node, NodeAttachment

VOLUME = "volume"
NETWORK_INTERFACE = "network-interface"
# Device names a volume may get, in order (the model's /dev/xvd[a-z], past the root's xvda).
_DEVICES = tuple(f"/dev/xvd{letter}" for letter in string.ascii_lowercase[1:])


class AttachmentService:
    def __init__(self, *, db: Database, clock: Clock) -> None:
        self.db = db
        self.clock = clock

    def _node(
        self, session: Session, name_or_arn: str, node_id: str, *, volumes: bool
    ) -> tuple[Cluster, Node]:
        cluster = get_cluster(session, name_or_arn, lock=True)
        if volumes and (not cluster.orchestrator or "Eks" not in cluster.orchestrator):
            raise ValidationException(
                f"Cluster '{cluster.name}' is not orchestrated by EKS; volumes can be attached to nodes of "
                "EKS-orchestrated clusters only."
            )
        if cluster.status != ClusterStatus.IN_SERVICE:
            raise ValidationException(f"Cluster '{cluster.name}' is {cluster.status}; it must be InService.")
        node = session.get(Node, node_id)
        if node is None or node.cluster_id != cluster.id or node.status == NodeStatus.SHUTTING_DOWN:
            raise ResourceNotFound(f"Node '{node_id}' does not exist in cluster '{cluster.name}'.")
        group = session.scalars(
            select(InstanceGroup).where(
                InstanceGroup.cluster_id == cluster.id, InstanceGroup.name == node.group_name
            )
        ).one_or_none()
        if group is not None and group.restricted:
            raise ValidationException(
                f"Node '{node_id}' is in restricted instance group '{group.name}'; nothing can be "
                "attached to it."
            )
        return cluster, node

    def _held(self, session: Session, kind: str, resource_id: str) -> NodeAttachment | None:
        return session.scalars(
            select(NodeAttachment).where(
                NodeAttachment.kind == kind, NodeAttachment.resource_id == resource_id
            )
        ).one_or_none()

    def attach_volume(
        self, *, cluster_arn: str, node_id: str, volume_id: str
    ) -> tuple[Cluster, NodeAttachment]:
        with self.db.write() as session:
            cluster, node = self._node(session, cluster_arn, node_id, volumes=True)
            if self._held(session, VOLUME, volume_id) is not None:
                raise ValidationException(f"Volume '{volume_id}' is already attached; it must be available.")
            used = set(
                session.scalars(select(NodeAttachment.device_name).where(NodeAttachment.node_id == node.id))
            )
            device = next((name for name in _DEVICES if name not in used), None)
            if device is None:
                raise ValidationException(f"Node '{node_id}' has no free device name for another volume.")
            attachment = self._add(
                session, cluster, node, VOLUME, volume_id, device, f"vola-{secrets.token_hex(8)}"
            )
        return cluster, attachment

    def detach_volume(
        self, *, cluster_arn: str, node_id: str, volume_id: str
    ) -> tuple[Cluster, NodeAttachment]:
        with self.db.write() as session:
            cluster, node = self._node(session, cluster_arn, node_id, volumes=True)
            attachment = self._held(session, VOLUME, volume_id)
            if attachment is None or attachment.node_id != node.id:
                raise ResourceNotFound(f"Volume '{volume_id}' is not attached to node '{node_id}'.")
            session.delete(attachment)
        return cluster, attachment

    def attach_network_interface(
        self, *, name: str, node_id: str, network_interface_id: str
    ) -> tuple[Cluster, NodeAttachment]:
        with self.db.write() as session:
            cluster, node = self._node(session, name, node_id, volumes=False)
            if self._held(session, NETWORK_INTERFACE, network_interface_id) is not None:
                raise ValidationException(f"Network interface '{network_interface_id}' is already attached.")
            attachment = self._add(
                session,
                cluster,
                node,
                NETWORK_INTERFACE,
                network_interface_id,
                None,
                f"eni-attach-{secrets.token_hex(9)[:17]}",
            )
        return cluster, attachment

    def _add(
        self,
        session: Session,
        cluster: Cluster,
        node: Node,
        kind: str,
        resource_id: str,
        device: str | None,
        attachment_id: str,
    ) -> NodeAttachment:
        now: datetime = self.clock.now()
        attachment = NodeAttachment(
            id=attachment_id,
            cluster_id=cluster.id,
            node_id=node.id,
            kind=kind,
            resource_id=resource_id,
            device_name=device,
            attach_time=now,
        )
        session.add(attachment)
        return attachment
