"""Commands on a node: what ``node exec`` (and a job's ranks) need to run on one.

The control plane does not run the command: the caller does, on this machine, with the
environment handed out here (the node, its agent, its address, the control plane as the node
reaches it) and the mark by which the node's end ends it (hyperpod_sim/infra/node_processes.py).
Only the local provisioner's nodes are on this machine; a node runs commands once it is Running
(its agent answers), as a machine takes work once it is up.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.errors import ConflictException, ResourceNotFound, ValidationException
from hyperpod_sim.domain.lifecycle import NodeStatus
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Node


@dataclass(frozen=True)
class NodeSession:
    """Where a command runs: its node and the environment it gets."""

    cluster: str
    node_id: str
    address: str
    environment: dict[str, str]


@dataclass(kw_only=True, eq=False)
class NodeSessionService(DomainService):
    provisioner: Provisioner
    provisioning_mode: str

    def open_session(self, *, name: str, node_id: str) -> NodeSession:
        """The environment of a command about to run on node ``node_id``."""
        if not self.provisioner.owns_agents:
            raise ValidationException(
                f"Commands run on the nodes of the local provisioner only (they are processes on this "
                f"machine); this control plane provisions nodes in '{self.provisioning_mode}' mode "
                "(HPSIM_PROVISIONING__MODE=local)."
            )
        with self.db.read() as session:
            cluster = get_cluster(session, name)
            node = session.scalars(
                select(Node).where(Node.cluster_id == cluster.id, Node.id == node_id)
            ).one_or_none()
            if node is None:
                raise ResourceNotFound(f"Node '{node_id}' does not exist in cluster '{cluster.name}'.")
            if node.status != NodeStatus.RUNNING or not node.endpoint:
                raise ConflictException(
                    f"Node '{node_id}' is {node.status}: commands run on a Running node "
                    "(wait for it: hyperpod-sim cluster wait, or DescribeClusterNode)."
                )
            environment = self.provisioner.session_environment(cluster, node)
            return NodeSession(
                cluster=cluster.name,
                node_id=node.id,
                address=environment["HPSIM_NODE_ADDRESS"],
                environment=environment,
            )
