"""Node operations: BatchRebootClusterNodes and BatchReplaceClusterNodes, and the reconciler's
part of a reboot.

What HyperPod documents (botocore's SageMaker model, 1.44.x), and what it means here:

- **Reboot** is a "soft recovery": EC2 ``RebootInstances``, which shuts the operating system down
  cleanly and starts it again. The instance, and its id, stay. Here the node's agent is stopped
  gracefully (SIGTERM: it drains the steps it has not persisted to S3 yet; SIGKILL after the
  provisioner's grace period), the node's shared memory is cleared (a reboot empties CPU memory),
  and the agent starts again on the same node, with the same node id and slot: the job finds its
  shards again on the node's replica peer, or on S3. The node is ``Pending`` from the request
  until its agent has registered again and applied the current policy, then ``Running`` (the
  model's instance statuses have no rebooting one).
- **Replace** "terminates the specified instances and provisions new replacement instances with
  the same configuration but fresh hardware", and "destroys all instance volumes". A new EC2
  instance has a new instance id, so the replacement gets a new node id (and a new private IP and
  logical id), as an automatic replacement does (hyperpod_sim/domain/nodes/health.py); it takes the
  replaced node's slot in its group, so the replica ring keeps its order. The replaced node shuts
  down as a deleted one does (its agent drains to S3 first; then its shared memory and data
  directory go), and the group's target count stays.

Per-node failures are answered in the model's shape (``Failed`` / ``FailedNodeLogicalIds`` with
the model's ``ErrorCode`` values), the rest of the batch goes on; a cluster that does not exist
is ``ResourceNotFound`` (the only error the model lists). ``NodeLogicalIds`` are accepted only on
a cluster with ``NodeProvisioningMode: Continuous``, as the model says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events, faults, node_batch
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.cluster_reads import locked_cluster
from hyperpod_sim.domain.errors import ValidationException
from hyperpod_sim.domain.events import Level
from hyperpod_sim.domain.lifecycle import MUTABLE, NodeStatus, bump_generation
from hyperpod_sim.domain.node_batch import NodeBatch
from hyperpod_sim.domain.node_operations import move as move_nodes
from hyperpod_sim.domain.nodes import credentials, recovery
from hyperpod_sim.domain.operation_records import OperationType
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, Node

REBOOT = "Reboot"
SOFTWARE_UPDATE = "SoftwareUpdate"
# A node added by BatchAddClusterNodes, or moved in by MoveClusterNodes, whose agent the
# reconciler is to start.
LAUNCH = "Launch"
# The status a node has while each restarting operation is under way (a move stops the agent as
# a reboot does, then hands the node off to its target group: domain/node_operations/move.py).
_RESTARTS = {
    REBOOT: NodeStatus.PENDING,
    SOFTWARE_UPDATE: NodeStatus.SYSTEM_UPDATING,
    move_nodes.MOVE: NodeStatus.DETACH_IN_PROGRESS,
}
# The statuses in which a node waits for the launch of its agent.
_LAUNCHED = (NodeStatus.PENDING, NodeStatus.ATTACH_IN_PROGRESS)
# Statuses from which a node can be rebooted or replaced.
ACTIONABLE = (NodeStatus.RUNNING, NodeStatus.FAILURE)


Act = Callable[[Session, Cluster, Node, datetime], None]


@dataclass(kw_only=True, eq=False)
class NodeOperations(DomainService):
    """The API side of node operations. Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    def batch_reboot(
        self, *, name: str, node_ids: list[str] | None = None, node_logical_ids: list[str] | None = None
    ) -> tuple[NodeBatch, NodeBatch]:
        """Reboot nodes: each is Pending until its agent, stopped and started again by the
        reconciler (``carry_out_reboots``), is back with the current policy."""
        return self._batch(name, node_ids, node_logical_ids, verb="rebooted", act=self._reboot)

    def batch_replace(
        self, *, name: str, node_ids: list[str] | None = None, node_logical_ids: list[str] | None = None
    ) -> tuple[NodeBatch, NodeBatch]:
        """Replace nodes: each shuts down, and the reconciler launches a new one in its slot."""
        return self._batch(name, node_ids, node_logical_ids, verb="replaced", act=self._replace)

    # ------------------------------------------------------------------ the batch

    def _batch(
        self,
        name: str,
        node_ids: list[str] | None,
        node_logical_ids: list[str] | None,
        *,
        verb: str,
        act: Act,
    ) -> tuple[NodeBatch, NodeBatch]:
        if not node_ids and not node_logical_ids:
            raise ValidationException("Specify NodeIds or NodeLogicalIds (or both).")
        with self.db.write() as session:
            cluster = locked_cluster(session, name)
            if node_logical_ids and not cluster.extra.continuous:
                raise ValidationException(
                    f"NodeLogicalIds are supported only for clusters whose NodeProvisioningMode is "
                    f"Continuous; cluster '{cluster.name}' is not: use NodeIds."
                )
            now = self.clock.now()
            by_id, by_logical = node_batch.run_both(
                cluster.nodes,
                node_ids,
                node_logical_ids,
                refuse=lambda node, key: _refusal(cluster, node, key, verb),
                act=lambda node: act(session, cluster, node, now),
            )
            acted = [n.id for n in node_batch.acted_on(cluster.nodes, by_id, by_logical)]
            if acted and verb == "replaced":
                bump_generation(cluster)  # the replica ring changed
            if acted:
                operations.start_operation(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    type=OperationType.REPLACE if verb == "replaced" else OperationType.REBOOT,
                    requested_by="BatchReplaceClusterNodes"
                    if verb == "replaced"
                    else "BatchRebootClusterNodes",
                    node_ids=acted,
                )
        self.on_change()
        return by_id, by_logical

    # ------------------------------------------------------------------ per node

    def _reboot(self, session: Session, cluster: Cluster, node: Node, now: datetime) -> None:
        node.pending_action = REBOOT
        node.status_message = "Rebooting (BatchRebootClusterNodes)."
        # Not Running again before its agent has registered anew (hyperpod_sim/domain/reconciler.py).
        node.registered_at = None
        events.move(
            session,
            node,
            NodeStatus.PENDING,
            ids=self.ids,
            now=now,
            description=f"Node {node.id} is rebooting (BatchRebootClusterNodes): its agent stops (after "
            "persisting its unpersisted steps to S3), its shared memory is cleared, and it starts again "
            "with the same node id.",
        )

    def _replace(self, session: Session, cluster: Cluster, node: Node, now: datetime) -> None:
        # The user replaces a node of its group: a stopped automatic recovery resumes
        # (domain/nodes/recovery.py).
        recovery.resume(session, cluster, [node.group_name], now, ids=self.ids, by="BatchReplaceClusterNodes")
        node.status_message = "Replaced (BatchReplaceClusterNodes)."
        events.move(
            session,
            node,
            NodeStatus.SHUTTING_DOWN,
            ids=self.ids,
            now=now,
            level=Level.WARN,
            description=f"Node {node.id} is being replaced (BatchReplaceClusterNodes): it shuts down (its "
            "agent persists its unpersisted steps to S3 first) and a new instance on fresh hardware, with "
            f"a new node id, takes its slot in group {node.group_name}; its memory and volumes are gone.",
        )
        # Its credentials die with it: the replacement registers with a secret of its own.
        credentials.revoke(node)


def _refusal(cluster: Cluster, node: Node | None, key: str, verb: str) -> tuple[str, str] | None:
    """Why ``node`` (named ``key``) cannot be rebooted or replaced now, as (error code, message)."""
    if node is None:
        return "InstanceIdNotFound", f"Node {key} is not part of cluster '{cluster.name}'."
    if cluster.status not in MUTABLE:
        return (
            "InvalidInstanceStatus",
            f"Cluster '{cluster.name}' is {cluster.status}; nodes can be {verb} only while it is InService.",
        )
    if node.pending_action is not None:
        return (
            "InstanceIdInUse",
            f"Node {node.id} has an operation in progress ({node.pending_action}); wait for it to complete "
            "before retrying.",
        )
    if node.status not in ACTIONABLE:
        return (
            "InvalidInstanceStatus",
            f"Node {node.id} is {node.status}; only a Running or Failure node can be {verb}.",
        )
    if verb == "rebooted" and node.id in faults.lost_nodes(cluster):
        return (
            "InvalidInstanceStatus",
            f"Node {node.id} was lost (a NodeLoss fault is in force); it cannot be rebooted, only replaced.",
        )
    return None


# ---------------------------------------------------------------------- the reconciler's part


def carry_out_restarts(
    session: Session,
    cluster: Cluster,
    now: datetime,
    *,
    ids: Ids,
    provisioner: Provisioner,
    ready_delay_s: float,
) -> Outcome:
    """One reconcile phase: the agent of each node being rebooted (or updated, in its batch of a
    rolling software update, or moved by MoveClusterNodes) is stopped gracefully (it drains to S3);
    once it is gone, the node's shared memory is cleared and its agent started again, as a new
    process that registers with a new launch secret (a moved node's, once it is handed off to its
    target cluster, by that cluster's pass). Until then the node is not failed for its agent's silence
    (``restart_pending``)."""
    outcome = Outcome()
    for node in list(cluster.nodes):  # a moved node leaves the list
        if node.pending_action == LAUNCH:
            node.pending_action = None
            if node.status in _LAUNCHED:
                node.ready_at = now + timedelta(seconds=ready_delay_s)
                if provisioner.uses_agents:
                    outcome.launches.append(node.id)
                outcome.changed = True
            continue
        expected = _RESTARTS.get(node.pending_action or "")
        if expected is None:
            continue
        if node.status != expected:  # deleted or failed meanwhile
            node.pending_action = None
            continue
        outcome.restart_pending.add(node.id)
        if provisioner.owns_agents:
            provisioner.stop_agent(node)
            if not provisioner.has_stopped(node):
                outcome.converged = False  # looked at again on the next tick
                continue
            provisioner.wipe_memory(node)
            if node.pending_action == move_nodes.MOVE:
                outcome.merge(_hand_off(session, cluster, node, now, ids=ids))
                continue
            # The agent registers again (with a new launch secret) and applies the policy anew; it
            # has the launch timeout to do so, counted from now.
            node.endpoint = None
            node.acked_generation = 0
            node.agent_restarted_at = now
            node.last_heartbeat = node.last_heartbeat or now
            outcome.launches.append(node.id)
            what = "its agent stopped and its shared memory was cleared; the agent is starting again"
        elif node.pending_action == move_nodes.MOVE:
            # Without agent processes of its own, the control plane hands the node off at once (an
            # external agent registers with the target cluster's bootstrap token); simulated nodes
            # take the launch delay to detach.
            if not provisioner.uses_agents and not _detached(node, now, ready_delay_s, outcome):
                continue
            outcome.merge(_hand_off(session, cluster, node, now, ids=ids))
            continue
        elif provisioner.uses_agents:
            # Its agent, started elsewhere, stays registered; it applies the policy again.
            node.registered_at = now
            node.acked_generation = 0
            what = (
                "the control plane does not run its agent (external provisioning); the policy is sent again"
            )
        else:
            node.ready_at = now + timedelta(seconds=ready_delay_s)
            what = "it is Running again after the launch delay"
        action = node.pending_action
        node.pending_action = None
        if action == REBOOT:
            node.status_message = None
        events.node_event(
            session,
            node,
            f"Node {node.id} {'rebooted' if action == REBOOT else 'restarted for its update'}: {what}.",
            ids=ids,
            now=now,
        )
        outcome.changed = True
    return outcome


def _hand_off(session: Session, cluster: Cluster, node: Node, now: datetime, *, ids: Ids) -> Outcome:
    """A moving node whose agent has stopped goes to its target group (domain/node_operations/move.py), where
    the target cluster's pass starts its new agent (LAUNCH)."""
    if not move_nodes.hand_off(session, cluster, node, now, ids=ids):
        return Outcome(converged=False)  # the target cluster is held by another pass: next time
    if node.status == NodeStatus.ATTACH_IN_PROGRESS:
        node.pending_action = LAUNCH
    # The target cluster's pass launches the agent: right away, not after the reconcile interval.
    outcome = Outcome(changed=True, again=True)
    outcome.note_due(now)
    return outcome


def _detached(node: Node, now: datetime, delay_s: float, outcome: Outcome) -> bool:
    """Whether a simulated node's detach (the launch delay, from the first pass that saw it) is over."""
    if node.action_due_at is None:
        node.action_due_at = now + timedelta(seconds=delay_s)
        outcome.changed = True
    if now < node.action_due_at:
        outcome.note_due(node.action_due_at)
        return False
    node.action_due_at = None
    return True
