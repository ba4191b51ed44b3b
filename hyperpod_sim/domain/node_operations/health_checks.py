"""StartClusterHealthCheck: deep health checks of Running nodes, and what follows a failed one.

What HyperPod documents (botocore's SageMaker model, 1.44.x): the checks run on the nodes named
(``InstanceIds``) or on every node of each group (``DeepHealthCheckConfigurations``); their progress
shows in DescribeClusterNode (status ``DeepHealthCheckInProgress``); "the unhealthy nodes will be
automatically rebooted or replaced". Here a check takes ``DEEP_HEALTH_CHECK_S`` (minutes on
HyperPod; there is no hardware here to stress), the node's agent keeps running through it, and a
node fails only where a ``DeepHealthCheckFailure`` fault is in force on it (hyperpod_sim/domain/
faults.py): such a node is Failure ("failed its deep health check"), and with ``NodeRecovery:
Automatic`` it is replaced (fresh hardware, as for a failed stress test: a reboot would not mend
it); with ``None`` it stays Failure, for the operator to reboot or replace. A node that passes is
Running again. The cluster stays InService.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events, faults
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.cluster_reads import locked_cluster
from hyperpod_sim.domain.errors import ValidationException
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import MUTABLE, NodeStatus, bump_generation
from hyperpod_sim.domain.nodes import credentials
from hyperpod_sim.domain.nodes.node_set import fail_node
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster
from hyperpod_sim.models.software_update import HealthCheckConfiguration

HEALTH_CHECK = "HealthCheck"
DEEP_HEALTH_CHECK_S = 5.0


@dataclass(kw_only=True, eq=False)
class HealthCheckService(DomainService):
    """Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    def start(self, *, name: str, configurations: list[HealthCheckConfiguration]) -> Cluster:
        now = self.clock.now()
        with self.db.write() as session:
            cluster = locked_cluster(session, name)
            if cluster.status not in MUTABLE:
                raise ValidationException(
                    f"Cluster '{cluster.name}' is {cluster.status}; deep health checks start only while it "
                    "is InService."
                )
            groups = {g.name for g in cluster.instance_groups}
            chosen: dict[str, list[str]] = {}
            for config in configurations:
                group = config.instance_group_name
                if group not in groups:
                    raise ValidationException(
                        f"Instance group '{group}' does not exist in cluster '{cluster.name}'."
                    )
                members = {n.id: n for n in cluster.nodes if n.group_name == group}
                wanted = config.instance_ids or [
                    n.id for n in members.values() if n.status == NodeStatus.RUNNING
                ]
                for node_id in wanted:
                    node = members.get(node_id)
                    if node is None:
                        raise ValidationException(f"Node {node_id} is not part of instance group '{group}'.")
                    if node.status != NodeStatus.RUNNING or node.pending_action is not None:
                        raise ValidationException(
                            f"Node {node_id} is {node.status}; deep health checks run on Running nodes only."
                        )
                    chosen.setdefault(node_id, [])
                    chosen[node_id] += [c for c in config.deep_health_checks if c not in chosen[node_id]]
            nodes = {n.id: n for n in cluster.nodes}
            for node_id, checks in chosen.items():
                node = nodes[node_id]
                node.pending_action = HEALTH_CHECK
                node.action_due_at = now + timedelta(seconds=DEEP_HEALTH_CHECK_S)
                node.status_message = f"Deep health checks: {', '.join(checks)}."
                events.move(
                    session,
                    node,
                    NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    description=f"Deep health checks started on node {node.id}: {', '.join(checks)}.",
                )
            if chosen:
                operations.start_operation(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    type=operations.OperationType.DEEP_HEALTH_CHECK,
                    requested_by="StartClusterHealthCheck",
                    node_ids=list(chosen),
                    health_checks=[
                        config.model_copy(
                            update={
                                "instance_ids": [
                                    n for n in chosen if nodes[n].group_name == config.instance_group_name
                                ]
                            }
                        )
                        for config in configurations
                    ],
                )
        self.on_change()
        return cluster


def finish_health_checks(session: Session, cluster: Cluster, now: datetime, *, ids: Ids) -> Outcome:
    """One reconcile phase: checks whose time is up pass (Running) or fail (Failure; replaced with
    NodeRecovery: Automatic: shut down, and a new node takes its slot)."""
    outcome = Outcome()
    failing = faults.failing_health_checks(cluster)
    replaced = False
    for node in cluster.nodes:
        if node.pending_action != HEALTH_CHECK:
            continue
        if node.status != NodeStatus.DEEP_HEALTH_CHECK_IN_PROGRESS:
            node.pending_action = None
            continue
        due = node.action_due_at or now
        if now < due:
            outcome.note_due(due)
            continue
        checks = (node.status_message or "").removeprefix("Deep health checks: ").rstrip(".")
        node.pending_action = None
        node.action_due_at = None
        outcome.changed = True
        if node.id not in failing:
            node.status_message = None
            events.move(
                session,
                node,
                NodeStatus.RUNNING,
                ids=ids,
                now=now,
                cluster=cluster,
                description=f"Node {node.id} passed its deep health checks ({checks}).",
            )
            continue
        fail_node(session, cluster, node, now, f"it failed its deep health checks ({checks})", ids=ids)
        if cluster.node_recovery != "Automatic":
            continue
        events.move(
            session,
            node,
            NodeStatus.SHUTTING_DOWN,
            ids=ids,
            now=now,
            cluster=cluster,
            level=Level.WARN,
            description=f"Node {node.id} is replaced after its failed deep health checks (NodeRecovery: "
            "Automatic): a new instance on fresh hardware takes its slot.",
        )
        credentials.revoke(node)
        replaced = True
    if replaced:
        bump_generation(cluster)
        outcome.again = True
    return outcome
