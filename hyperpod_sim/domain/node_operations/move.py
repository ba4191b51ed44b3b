"""MoveClusterNodes: running nodes move from one instance group to another, of the same cluster or
of another, without being terminated.

What HyperPod documents (botocore's SageMaker model, 1.44.x), and what it means here:

- Each node keeps its instance id, its ``NodeLogicalId``, its network interfaces and IP address
  and its launch time; it joins the target group "with the target's configuration and lifecycle
  scripts", and "the move replaces the node's root ... and secondary EBS volume". Here: the node is
  ``DetachInProgress`` in its source cluster while its agent is stopped gracefully, as a reboot
  stops it (domain/node_operations/reboot_replace.py ``carry_out_restarts``: SIGTERM, so it persists
  its unpersisted steps to S3 in the source cluster's namespaces; SIGKILL after the grace period);
  its shared memory is cleared and its credentials for the source cluster revoked. Then it is
  handed off (:func:`hand_off`): it is a node of the target group, ``AttachInProgress``, and a new
  agent starts on it as a member of the target cluster, with a launch secret of its own, and
  registers there; it is ``Running`` once it has applied the target cluster's policy (its tiered
  storage, checkpoint policy and replica ring).
- The replica rings: the node leaves the source cluster's ring at the request (a new policy
  generation there; its peers stop counting on it) and joins the target's at the hand-off (a new
  generation there).
- Counts: the source group's target count goes down at the request (the detaching node counts
  towards none of its counts), the target group's goes up at the hand-off, when the node appears
  there.
- Both clusters must be ``InService``, orchestrated by EKS, with ``NodeProvisioningMode:
  Continuous``; a move within one cluster must name another group. ``NodeIds`` or
  ``NodeLogicalIds`` are evaluated node by node (``Failed`` / ``FailedNodeLogicalIds`` with the
  model's codes); if none can move, the request fails and nothing moves. ``InstanceCount``: the
  newest eligible nodes of the source group are picked; fewer eligible than asked fails the
  request. A move that would take the source group below its ``MinInstanceCount`` fails.
- Compatible groups (the model: "must use compatible configurations"): what is checked here is
  the instance type (``NodeInstanceTypeMismatch``: the target group's type, or one of its
  ``InstanceRequirements`` types), the subnet (``InvalidNodeStatus`` when the groups' subnets, a
  group's ``OverrideVpcConfig`` or else its cluster's ``VpcConfig``, have none in common) and
  restricted groups (neither may be one). A node with an EBS volume attached
  (AttachClusterNodeVolume) must have it detached first, as the model says; its network interfaces
  move with it.
- ``ClientToken`` (domain/client_tokens.py, scoped to the source cluster): the same token with
  the same parameters within 8 hours answers the first answer and starts nothing; with other
  parameters it is a ``ValidationException`` (the model lists no error of its own for that).

What hyperpod-sim adds: a node with a node fault in force (a NodeLoss, an AgentHang, ...) cannot
move (``InvalidNodeStatus``); a target cluster or group deleted while the node detaches takes it
back into its own group (``AttachInProgress`` there), or, its own group gone too, it shuts down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session, selectinload

from hyperpod_sim.domain import client_tokens, events, faults, node_batch
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.cluster_reads import get_cluster
from hyperpod_sim.domain.clusters import rules as cluster_rules
from hyperpod_sim.domain.errors import ResourceNotFound, ValidationException
from hyperpod_sim.domain.lifecycle import (
    LEAVING,
    MUTABLE,
    ClusterStatus,
    GroupStatus,
    NodeStatus,
    bump_generation,
)
from hyperpod_sim.domain.node_batch import NODE_IDS, NodeBatch
from hyperpod_sim.domain.nodes import credentials
from hyperpod_sim.domain.nodes.attachments import VOLUME
from hyperpod_sim.domain.operation_records import OperationType
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, InstanceGroup, Node, NodeAttachment
from hyperpod_sim.models.node_sets import MoveRequest, NodeMove

MOVE = "Move"
REQUESTED_BY = "MoveClusterNodes"
MAX_NODES = 50


@dataclass(kw_only=True, eq=False)
class MoveNodesService(DomainService):
    """Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    max_instances: int

    def move(self, *, request: MoveRequest, client_token: str | None = None) -> NodeBatch:
        named = [
            key
            for key, value in (
                ("NodeIds", request.node_ids),
                ("NodeLogicalIds", request.node_logical_ids),
                ("InstanceCount", request.instance_count),
            )
            if value is not None
        ]
        if len(named) != 1:
            raise ValidationException(
                "Specify exactly one of NodeIds, NodeLogicalIds or InstanceCount"
                + (f"; the request names {' and '.join(named)}." if named else ".")
            )
        by = named[0]
        parameters = request.wire()
        now = self.clock.now()
        with self.db.write() as session:
            source, target = _lock_both(session, request.source_cluster_arn, request.target_cluster_arn)
            answered = client_tokens.earlier(
                session,
                cluster=source,
                operation="MoveClusterNodes",
                token=client_token,
                parameters=parameters,
                now=now,
                mismatch=ValidationException,
            )
            if answered is not None:
                return NodeBatch.from_stored(answered.result)
            source_group, target_group = self._check(
                source, target, request.source_instance_group_name, request.target_instance_group_name
            )
            moving: list[Node] = []
            count = request.instance_count
            if count is not None:
                moving = self._pick(session, source, source_group, target, target_group, count)
                result = NodeBatch(by=by, successful=[n.id for n in moving])
            else:
                result = node_batch.run(
                    source.nodes,
                    request.node_ids if by == NODE_IDS else request.node_logical_ids,
                    by=by,
                    refuse=lambda node, key: _refusal(
                        session, source, source_group, target, target_group, node, key
                    ),
                    act=moving.append,
                )
                if not moving:
                    reasons = "; ".join(f"{key}: {code} ({message})" for key, code, message in result.failed)
                    raise ValidationException(f"None of the nodes can be moved, so none was: {reasons}")
            self._check_counts(source, source_group, target, len(moving))
            self._start(session, now, source, source_group, target, target_group, moving)
            client_tokens.remember(
                session,
                cluster=source,
                operation="MoveClusterNodes",
                token=client_token,
                parameters=parameters,
                result=asdict(result),
                now=now,
            )
            move_record = {"Request": parameters, "Result": asdict(result)}
            operations.start_operation(
                session,
                ids=self.ids,
                now=now,
                cluster=source,
                type=OperationType.MOVE,
                requested_by=REQUESTED_BY,
                node_ids=[n.id for n in moving],
                move=move_record,
            )
            if target is not source:
                operations.start_operation(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=target,
                    type=OperationType.MOVE,
                    requested_by=REQUESTED_BY,
                    node_ids=[n.id for n in moving],
                )
        self.on_change()
        return result

    # ------------------------------------------------------------------ checks

    def _check(
        self, source: Cluster, target: Cluster, source_group_name: str, target_group_name: str
    ) -> tuple[InstanceGroup, InstanceGroup]:
        for cluster in (source, target) if target is not source else (source,):
            if cluster.status not in MUTABLE:
                raise ValidationException(
                    f"Cluster '{cluster.name}' is {cluster.status}; nodes can be moved only between clusters "
                    "that are InService."
                )
            if not cluster.orchestrator or "Eks" not in cluster.orchestrator:
                raise ValidationException(
                    f"Cluster '{cluster.name}' is not orchestrated by EKS; MoveClusterNodes moves nodes "
                    "between EKS-orchestrated clusters only."
                )
            if not cluster.extra.continuous:
                raise ValidationException(
                    f"MoveClusterNodes is supported only for clusters whose NodeProvisioningMode is "
                    f"Continuous; cluster '{cluster.name}' is not."
                )
        if target is source and source_group_name == target_group_name:
            raise ValidationException(
                f"The target instance group '{target_group_name}' is the source instance group; within one "
                "cluster, nodes can be moved only to another instance group."
            )
        groups = []
        for cluster, name in ((source, source_group_name), (target, target_group_name)):
            group = next((g for g in cluster.instance_groups if g.name == name), None)
            if group is None:
                raise ResourceNotFound(f"Instance group '{name}' does not exist in cluster '{cluster.name}'.")
            if group.restricted:
                raise ValidationException(
                    f"Instance group '{name}' of cluster '{cluster.name}' is a restricted instance group; "
                    "nodes cannot be moved from or to one."
                )
            if group.status not in (GroupStatus.IN_SERVICE, GroupStatus.UPDATING, GroupStatus.DEGRADED):
                raise ValidationException(
                    f"Instance group '{name}' of cluster '{cluster.name}' is {group.status}; nodes can be "
                    "moved only from and to an InService group."
                )
            groups.append(group)
        return groups[0], groups[1]

    def _pick(
        self,
        session: Session,
        source: Cluster,
        source_group: InstanceGroup,
        target: Cluster,
        target_group: InstanceGroup,
        count: int,
    ) -> list[Node]:
        """The ``count`` newest eligible nodes of the source group (HyperPod does not say which it
        picks; a scale-down here picks the newest too)."""
        candidates = sorted(
            (n for n in source.nodes if n.group_name == source_group.name),
            key=lambda n: (n.launch_time, n.id),
            reverse=True,
        )
        eligible = [
            n
            for n in candidates
            if _refusal(session, source, source_group, target, target_group, n, n.id) is None
        ]
        if len(eligible) < count:
            raise ValidationException(
                f"InstanceCount asks for {count} nodes, but instance group '{source_group.name}' of cluster "
                f"'{source.name}' has {len(eligible)} that can be moved now (Running, of an instance type "
                f"the target group '{target_group.name}' runs, no operation in progress, no EBS volume "
                "attached); no node was moved."
            )
        return eligible[:count]

    def _check_counts(
        self, source: Cluster, source_group: InstanceGroup, target: Cluster, moving: int
    ) -> None:
        minimum = source_group.spec.min_instance_count or 0
        staying = _group_count(source, source_group.name) - moving
        if staying < minimum:
            raise ValidationException(
                f"Moving {moving} nodes would take instance group '{source_group.name}' of cluster "
                f"'{source.name}' to {staying} nodes, below its minimum instance count ({minimum}); no "
                "node was moved."
            )
        if target is not source:
            live = sum(1 for n in target.nodes if n.status not in LEAVING)
            cluster_rules.check_instance_limit(live + moving, self.max_instances)

    # ------------------------------------------------------------------ the move's start

    def _start(
        self,
        session: Session,
        now: datetime,
        source: Cluster,
        source_group: InstanceGroup,
        target: Cluster,
        target_group: InstanceGroup,
        moving: list[Node],
    ) -> None:
        where = f"group {target_group.name} of cluster '{target.name}'"
        for node in moving:
            node.pending_action = MOVE
            node.move = NodeMove(
                source_cluster_id=source.id,
                source_group=source_group.name,
                target_cluster_id=target.id,
                target_group=target_group.name,
            )
            node.status_message = f"Moving to {where} (MoveClusterNodes)."
            events.move(
                session,
                node,
                NodeStatus.DETACH_IN_PROGRESS,
                ids=self.ids,
                now=now,
                cluster=source,
                description=f"Node {node.id} is moving to {where} (MoveClusterNodes): it leaves this "
                "cluster's replica ring, its agent stops (after persisting its unpersisted steps to S3), and "
                "its shared memory and volumes are cleared.",
            )
        source_group.target_count -= len(moving)
        source_group.spec = source_group.spec.model_copy(update={"instance_count": source_group.target_count})
        events.record(
            session,
            ids=self.ids,
            now=now,
            cluster=source,
            group_name=source_group.name,
            description=f"{len(moving)} nodes are moving out of group {source_group.name} to {where} "
            f"(MoveClusterNodes); its target count is {source_group.target_count}.",
        )
        events.record(
            session,
            ids=self.ids,
            now=now,
            cluster=target,
            group_name=target_group.name,
            description=f"{len(moving)} nodes are moving into group {target_group.name} from group "
            f"{source_group.name} of cluster '{source.name}' (MoveClusterNodes): "
            f"{', '.join(n.id for n in moving)}.",
        )
        bump_generation(source)  # the detaching nodes left its replica ring


def _lock_both(session: Session, source_arn: str, target_arn: str) -> tuple[Cluster, Cluster]:
    """Both clusters, with their nodes and groups, locked in the order of their ids (two moves in
    opposite directions cannot deadlock)."""
    keys = {source_arn: get_cluster(session, source_arn).id, target_arn: get_cluster(session, target_arn).id}
    locked: dict[str, Cluster] = {}
    for cluster_id in sorted(set(keys.values())):
        cluster = session.scalars(
            select(Cluster)
            .where(Cluster.id == cluster_id)
            .options(selectinload(Cluster.nodes), selectinload(Cluster.instance_groups))
            .with_for_update()
            .execution_options(populate_existing=True)
        ).one_or_none()
        if cluster is None:  # deleted between the two reads
            raise ResourceNotFound(f"Cluster '{cluster_id}' does not exist.")
        locked[cluster_id] = cluster
    return locked[keys[source_arn]], locked[keys[target_arn]]


def _group_count(cluster: Cluster, group_name: str) -> int:
    return sum(1 for n in cluster.nodes if n.group_name == group_name and n.status not in LEAVING)


def _allowed_types(group: InstanceGroup) -> list[str]:
    return list(group.spec.instance_types)


def _subnets(cluster: Cluster, group: InstanceGroup) -> set[str]:
    vpc = group.spec.override_vpc_config or cluster.vpc_config or {}
    return set(vpc.get("Subnets") or [])


def _refusal(
    session: Session,
    source: Cluster,
    source_group: InstanceGroup,
    target: Cluster,
    target_group: InstanceGroup,
    node: Node | None,
    key: str,
) -> tuple[str, str] | None:
    """Why ``node`` (named ``key``) cannot move now, as (the model's error code, message)."""
    if node is None or node.group_name != source_group.name:
        return (
            "NodeIdNotFound",
            f"Node {key} is not part of instance group '{source_group.name}' of cluster '{source.name}'.",
        )
    if node.pending_action is not None:
        return (
            "NodeIdInUse",
            f"Node {node.id} has an operation in progress ({node.pending_action}); wait for it to complete "
            "before retrying.",
        )
    if node.status != NodeStatus.RUNNING:
        return "InvalidNodeStatus", f"Node {node.id} is {node.status}; only a Running node can be moved."
    allowed = _allowed_types(target_group)
    if node.instance_type not in allowed:
        return (
            "NodeInstanceTypeMismatch",
            f"Node {node.id} is a {node.instance_type}; instance group '{target_group.name}' of cluster "
            f"'{target.name}' runs {', '.join(allowed)}.",
        )
    ours, theirs = _subnets(source, source_group), _subnets(target, target_group)
    if ours and theirs and not ours & theirs:
        return (
            "InvalidNodeStatus",
            f"Node {node.id} is in subnet {', '.join(sorted(ours))}, not in a subnet of instance group "
            f"'{target_group.name}' of cluster '{target.name}' ({', '.join(sorted(theirs))}).",
        )
    volume = session.scalars(
        select(NodeAttachment.resource_id).where(
            NodeAttachment.node_id == node.id, NodeAttachment.kind == VOLUME
        )
    ).first()
    if volume is not None:
        return (
            "InvalidNodeStatus",
            f"Node {node.id} has EBS volume {volume} attached; detach it first (DetachClusterNodeVolume).",
        )
    fault = faults.on_node(source, node.id)
    if fault is not None:
        return (
            "InvalidNodeStatus",
            f"Node {node.id} has a {fault.type} fault in force; clear it before moving the node.",
        )
    return None


# ---------------------------------------------------------------------- the reconciler's part


def hand_off(session: Session, cluster: Cluster, node: Node, now: datetime, *, ids: Ids) -> bool:
    """Hand a detached node (its agent stopped, its memory cleared) off to its target group: from
    now on it is a node of the target cluster, AttachInProgress, whose agent that cluster's pass is
    to start with a launch secret of its own (the caller, ``node_operations.carry_out_restarts``,
    marks the launch). Whether it was handed off: False while another control plane's pass holds
    the target cluster (tried again on the next pass)."""
    move = node.move
    assert move is not None  # a node with the Move action pending has its record (move() sets both)
    target_id = move.target_cluster_id
    target: Cluster | None = cluster
    if target_id != cluster.id:
        target = session.scalars(
            select(Cluster)
            .where(Cluster.id == target_id)
            .options(selectinload(Cluster.nodes), selectinload(Cluster.instance_groups))
            .with_for_update(skip_locked=True)
        ).one_or_none()
        if target is None and session.scalar(select(Cluster.id).where(Cluster.id == target_id)):
            return False  # held by another pass
    group = _accepting_group(target, move.target_group)
    back = group is None
    if back:  # the target went meanwhile: the node goes back to its own group
        target, group = cluster, _accepting_group(cluster, move.source_group)
    source_group = move.source_group
    credentials.revoke(node)  # its tokens for the source cluster stop working
    if target is None or group is None:
        node.move = None
        node.pending_action = None
        events.move(
            session,
            node,
            NodeStatus.SHUTTING_DOWN,
            ids=ids,
            now=now,
            cluster=cluster,
            level=events.Level.WARN,
            description=f"Node {node.id} shuts down: neither its target group nor its own group "
            f"{source_group} exists any more (MoveClusterNodes).",
        )
        return True
    if target is not cluster:
        events.record(
            session,
            ids=ids,
            now=now,
            cluster=cluster,
            node=node,
            description=f"Node {node.id} detached from group {source_group} (MoveClusterNodes): its agent "
            f"stopped and its shared memory was cleared; it is now a node of group {group.name} of cluster "
            f"'{target.name}'.",
        )
        cluster.nodes.remove(node)
        target.nodes.append(node)
        session.execute(
            update(NodeAttachment).where(NodeAttachment.node_id == node.id).values(cluster_id=target.id)
        )
    taken = {n.slot for n in target.nodes if n.group_name == group.name and n.status not in LEAVING}
    node.slot = next(i for i in range(len(taken) + 1) if i not in taken)
    node.group_name = group.name
    node.image_version = group.spec.image_release_version
    # A new agent registers (with a new launch secret) and applies the target's policy; it has the
    # launch timeout to do so, counted from now.
    node.endpoint = None
    node.pid = None
    node.registered_at = None
    node.acked_generation = 0
    node.push_attempts = 0
    node.next_push_at = None
    node.push_claimed_until = None
    node.last_error = None
    node.s3_status = None
    node.agent_restarts = 0
    node.agent_restarted_at = now
    node.last_heartbeat = now
    node.pending_action = None  # the caller marks its agent's launch
    node.status_message = (
        f"Attaching to group {group.name} (MoveClusterNodes)."
        if not back
        else f"Attaching back to group {group.name}: its target group is gone (MoveClusterNodes)."
    )
    group.target_count += 1
    group.spec = group.spec.model_copy(update={"instance_count": group.target_count})
    origin = (
        f"from group {source_group} of cluster '{cluster.name}'"
        if target is not cluster
        else f"from group {source_group}"
    )
    events.move(
        session,
        node,
        NodeStatus.ATTACH_IN_PROGRESS,
        ids=ids,
        now=now,
        cluster=target,
        description=f"Node {node.id} is attaching to group {group.name} {origin} (MoveClusterNodes"
        f"{'; its target group is gone, so it goes back' if back else ''}): same instance id and logical "
        "id, new root and secondary volumes; its agent starts as a member of this cluster, with its policy.",
    )
    bump_generation(target)  # the node joins its replica ring
    return True


def _accepting_group(cluster: Cluster | None, name: str | None) -> InstanceGroup | None:
    if cluster is None or cluster.status == ClusterStatus.DELETING:
        return None
    group = next((g for g in cluster.instance_groups if g.name == name), None)
    if group is None or group.status in (GroupStatus.DELETING, GroupStatus.FAILED):
        return None
    return group
