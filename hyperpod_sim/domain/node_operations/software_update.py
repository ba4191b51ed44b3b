"""UpdateClusterSoftware: a rolling update of the nodes' image, batch by batch.

What HyperPod documents (botocore's SageMaker model, 1.44.x; the developer guide's "Update the
SageMaker HyperPod platform software of a cluster"), and what it means here:

- The cluster is ``SystemUpdating`` while the update rolls, ``InService`` again once every node
  runs the new image release. Each node of the batch being updated is ``SystemUpdating``: its
  agent is stopped gracefully (it drains its unpersisted steps to S3), its shared memory is cleared
  (the update restarts the instance, and replaces its root volume), and its agent starts again on
  the same node, with the same node id; it is ``Running`` again once the agent has registered and
  applied the current policy, on the new ``ImageReleaseVersion`` (``InstanceGroups[].
  ImageReleaseVersion``, or ``LATEST_RELEASE`` for the groups named without one, or for every group
  when none is named). ``ImageId`` is stored as the groups' image.
- ``DeploymentConfig.RollingUpdatePolicy.MaximumBatchSize``: at most that many nodes at a time
  (``INSTANCE_COUNT``: the value; ``CAPACITY_PERCENTAGE``: that share of the nodes being updated,
  at least 1). Without a ``DeploymentConfig`` every node is in one batch, as far as the rule below
  allows. ``WaitIntervalInSeconds``: the wait after a batch is done before the next one starts.
- ``AutoRollbackConfiguration`` names CloudWatch alarms; there is no CloudWatch here, so they are
  stored, said so in the update's event, and never fire: no update rolls back (the cluster status
  ``RollingBack``, and ``RollbackMaximumBatchSize``, are never used).
- Each updated group's ``SoftwareUpdateStatus`` (``InstanceGroup.software_update_status``) is
  ``InProgress`` from the request on (the first batch starts at once: never ``Pending``), and
  ``Succeeded`` once the update is done, kept until the group's next update: the model calls it
  the "status of the last software update request". Without rollbacks, ``RollbackInProgress``,
  ``RollbackComplete`` and ``Failed`` never happen; a node that fails its update is replaced as
  any failed node is, and the update goes on.
- Every node of the updated groups ends on the new release: a node that was not Running when
  its batch started (still launching, or moved in by MoveClusterNodes and ``AttachInProgress``),
  and one that joined the group during the update (a replacement), is updated in further batches
  after the planned ones, planned by the same rules once it is Running; the update waits for those
  still on their way (a node that fails instead is replaced as any failed node is). HyperPod does
  not say what it does with them; a group left half on the old release is what it must not do.
- What hyperpod-sim adds: a batch never holds a node and one of its replica peers (the nodes next
  to it in the replica ring, domain/checkpoints/node_policy.py) when that can be avoided, so the copy
  of a node's checkpoints on its peer survives the node's update. HyperPod itself does not say how
  it picks a batch. Batches may be smaller than ``MaximumBatchSize`` for it, never larger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from hyperpod_sim.domain import events
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.checkpoints.cluster_policy import CheckpointPolicy
from hyperpod_sim.domain.checkpoints.node_policy import ring
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.cluster_reads import locked_cluster
from hyperpod_sim.domain.errors import ConflictException, ValidationException
from hyperpod_sim.domain.lifecycle import (
    LIVE,
    MUTABLE,
    ClusterStatus,
    NodeStatus,
    SoftwareUpdateStatus,
    check_transition,
)
from hyperpod_sim.domain.node_operations.reboot_replace import SOFTWARE_UPDATE
from hyperpod_sim.domain.nodes.node_set import fail_node
from hyperpod_sim.domain.outcome import Outcome
from hyperpod_sim.domain.provisioning import Provisioner
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, InstanceGroup, Node
from hyperpod_sim.models.software_update import DeploymentConfig, GroupRelease, SoftwareUpdate

# The image release a node runs from its launch, and the one an update without a version installs.
INITIAL_RELEASE = "1.0.0"
LATEST_RELEASE = "1.1.0"


def release_of(node: Node, group_release: str | None) -> str | None:
    """The image release the node runs: its own once updated or moved, else its group's
    (``group_release``, the group's ImageReleaseVersion); None when neither names one (then it runs
    INITIAL_RELEASE, which DescribeClusterNode leaves out)."""
    return node.image_version or group_release


def image_release(node: Node, group: InstanceGroup | None) -> str:
    """The image release version the node runs."""
    group_release = group.spec.image_release_version if group is not None else None
    return release_of(node, group_release) or INITIAL_RELEASE


def _mark(group: InstanceGroup, status: SoftwareUpdateStatus) -> None:
    """The group's SoftwareUpdateStatus, through its transition table (a group never updated
    starts any sequence)."""
    if group.software_update_status is not None:
        check_transition(group.software_update_status, status)
    group.software_update_status = status.value


@dataclass(kw_only=True, eq=False)
class SoftwareUpdateService(DomainService):
    """Start a rolling update. Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    def update_cluster_software(
        self,
        *,
        name: str,
        instance_groups: list[GroupRelease] | None = None,
        deployment_config: DeploymentConfig | None = None,
        image_id: str | None = None,
    ) -> Cluster:
        now = self.clock.now()
        with self.db.write() as session:
            cluster = locked_cluster(session, name)
            if cluster.status not in MUTABLE:
                raise ConflictException(
                    f"Cluster '{cluster.name}' is {cluster.status}; UpdateClusterSoftware is accepted only "
                    "while the cluster is InService."
                )
            versions = _versions(cluster, instance_groups)
            nodes = [n for n in cluster.nodes if n.group_name in versions and n.status in LIVE]
            size = batch_size(deployment_config, len(nodes))
            batches = plan_batches(cluster, nodes, size)
            config = deployment_config or DeploymentConfig()
            rolling = config.rolling_update_policy
            alarms = [a.alarm_name for a in config.auto_rollback_configuration or []]
            cluster.software_update = SoftwareUpdate(
                versions=versions,
                batches=batches,
                batch=-1,  # none started yet
                wait_interval_in_seconds=config.wait_interval_in_seconds or 0,
                next_batch_at=now.timestamp(),
                maximum_batch_size=rolling.maximum_batch_size if rolling is not None else None,
                batch_size=size,  # for the batches of the nodes left behind (see roll)
                alarms=alarms,
            )
            for group in cluster.instance_groups:
                if group.name in versions:
                    _mark(group, SoftwareUpdateStatus.IN_PROGRESS)
                    if image_id is not None:
                        group.spec = group.spec.model_copy(update={"image_id": image_id})
            cluster.updated_time = now
            described = ", ".join(f"{group} to {version}" for group, version in versions.items())
            alarm_note = (
                f"; rollback alarms {', '.join(alarms)} are not monitored (no CloudWatch here)"
                if alarms
                else ""
            )
            events.move(
                session,
                cluster,
                ClusterStatus.SYSTEM_UPDATING,
                ids=self.ids,
                now=now,
                description=f"Software update started: {described}; {len(nodes)} nodes in {len(batches)} "
                f"batches{alarm_note}.",
            )
            operations.start_operation(
                session,
                ids=self.ids,
                now=now,
                cluster=cluster,
                type=operations.OperationType.SOFTWARE_UPDATE,
                requested_by="UpdateClusterSoftware",
                node_ids=[n.id for n in nodes],
            )
        self.on_change()
        return cluster


def _versions(cluster: Cluster, instance_groups: list[GroupRelease] | None) -> dict[str, str]:
    """Group name -> the image release it is updated to."""
    known = [g.name for g in cluster.instance_groups]
    if not instance_groups:
        return {name: LATEST_RELEASE for name in known}
    versions: dict[str, str] = {}
    for spec in instance_groups:
        group = spec.instance_group_name
        if group not in known:
            raise ValidationException(
                f"Instance group '{group}' does not exist in cluster '{cluster.name}'; its groups are "
                f"{', '.join(known)}."
            )
        if group in versions:
            raise ValidationException(f"Instance group '{group}' appears more than once in InstanceGroups.")
        versions[group] = spec.image_release_version or LATEST_RELEASE
    return versions


def batch_size(deployment_config: DeploymentConfig | None, count: int) -> int:
    """How many nodes a batch may hold at most."""
    rolling = deployment_config.rolling_update_policy if deployment_config is not None else None
    if rolling is None:
        return max(count, 1)
    size = rolling.maximum_batch_size
    if size.type == "CAPACITY_PERCENTAGE":
        return max(1, math.floor(count * size.value / 100))
    return size.value


def plan_batches(cluster: Cluster, nodes: Sequence[Node], size: int) -> list[list[str]]:
    """``nodes`` in batches of at most ``size``, in ring order, none holding a node and one of its
    replica peers while another batch can take it."""
    members = ring(cluster, [n for n in cluster.nodes if n.status in LIVE])
    position = {n.id: i for i, n in enumerate(members)}
    neighbours: dict[str, set[str]] = {}
    if len(members) > 1 and cluster.tiered_storage is not None and cluster.tiered_storage.enabled:
        factor = min(
            CheckpointPolicy.from_stored(cluster.checkpoint_policy).replication_factor, len(members) - 1
        )
        for i, node in enumerate(members):
            # Its peers (the next ``factor`` in the ring) and the nodes it is a peer of.
            for step in [*range(1, factor + 1), *range(-factor, 0)]:
                neighbours.setdefault(node.id, set()).add(members[(i + step) % len(members)].id)
    todo = sorted((n.id for n in nodes), key=lambda node_id: position.get(node_id, len(position)))
    batches: list[list[str]] = []
    while todo:
        batch: list[str] = []
        for node_id in todo:
            if len(batch) < size and not neighbours.get(node_id, set()) & set(batch):
                batch.append(node_id)
        batches.append(batch)
        todo = [n for n in todo if n not in batch]
    return batches


# ---------------------------------------------------------------------- the reconciler's part


def roll(
    session: Session,
    cluster: Cluster,
    now: datetime,
    *,
    ids: Ids,
    provisioner: Provisioner,
    launch_timeout_s: float = 60.0,
) -> Outcome:
    """One reconcile phase of a SystemUpdating cluster: nodes of the current batch that are back
    run the new release (a node whose agent did not register again within ``launch_timeout_s``
    fails, and is replaced as any failed node is); once the batch is done (and the wait interval
    passed) the next batch starts; after the last, the cluster is InService."""
    plan = cluster.software_update
    outcome = Outcome()
    if cluster.status != ClusterStatus.SYSTEM_UPDATING or plan is None:
        return outcome
    nodes = {n.id: n for n in cluster.nodes}
    index = plan.batch
    if index >= 0:
        batch = [nodes[n] for n in plan.batches[index] if n in nodes]
        for node in batch:
            outcome.changed |= _finish_node(
                session, cluster, node, now, plan, ids=ids, provisioner=provisioner
            )
        if any(n.status == NodeStatus.SYSTEM_UPDATING for n in batch):
            return outcome
        if plan.done_at is None:  # the batch is done now: the wait interval starts
            done = now.timestamp()
            plan = plan.model_copy(
                update={"done_at": done, "next_batch_at": done + plan.wait_interval_in_seconds}
            )
            cluster.software_update = plan
            outcome.changed = True
    if index + 1 >= len(plan.batches):
        behind, coming = left_behind(cluster, plan)
        if coming:
            return outcome  # their update waits until they run (or fail)
        if behind:
            plan = _more_batches(session, cluster, now, plan, behind, ids=ids)
    if index + 1 >= len(plan.batches):
        cluster.software_update = None
        for group in cluster.instance_groups:  # what DescribeCluster shows as current from now on
            if group.name in plan.versions:
                version = plan.versions[group.name]
                group.spec = group.spec.model_copy(update={"image_release_version": version})
                _mark(group, SoftwareUpdateStatus.SUCCEEDED)  # kept until the group's next update
        cluster.updated_time = now
        events.move(
            session,
            cluster,
            ClusterStatus.IN_SERVICE,
            ids=ids,
            now=now,
            description=f"Software update finished: {len(plan.batches)} batches updated.",
        )
        return Outcome(changed=True)
    due = datetime.fromtimestamp(plan.next_batch_at, tz=UTC)
    if now < due:
        outcome.note_due(due)
        return outcome
    _start_batch(session, cluster, now, plan, index + 1, nodes, ids=ids)
    outcome.changed = outcome.again = True
    return outcome


def left_behind(cluster: Cluster, plan: SoftwareUpdate) -> tuple[list[Node], list[Node]]:
    """The nodes of the updated groups not on their new release: those Running (to update now),
    and those on their way to Running (launching, moved in; to wait for). Nodes that failed or
    are leaving are neither."""
    groups = {g.name: g for g in cluster.instance_groups}
    behind: list[Node] = []
    coming: list[Node] = []
    for node in cluster.nodes:
        version = plan.versions.get(node.group_name)
        if version is None or image_release(node, groups.get(node.group_name)) == version:
            continue
        if node.status == NodeStatus.RUNNING:
            behind.append(node)
        elif node.status in LIVE and node.status != NodeStatus.FAILURE:
            coming.append(node)
    return behind, coming


def _more_batches(
    session: Session, cluster: Cluster, now: datetime, plan: SoftwareUpdate, behind: list[Node], *, ids: Ids
) -> SoftwareUpdate:
    """The planned batches are done; ``behind`` still runs the old release: more batches for it."""
    more = plan_batches(cluster, behind, plan.batch_size or len(behind))
    plan = plan.model_copy(update={"batches": [*plan.batches, *more]})
    cluster.software_update = plan
    listed = ", ".join(sorted(n.id for n in behind))
    events.record(
        session,
        ids=ids,
        now=now,
        cluster=cluster,
        description=f"Software update: {len(behind)} nodes that were not Running when their batch started, "
        f"or joined during the update, still run the old release ({listed}); they are updated in "
        f"{len(more)} more batches.",
    )
    return plan


def _start_batch(
    session: Session,
    cluster: Cluster,
    now: datetime,
    plan: SoftwareUpdate,
    index: int,
    nodes: dict[str, Node],
    *,
    ids: Ids,
) -> None:
    batch = [nodes[n] for n in plan.batches[index] if n in nodes and nodes[n].status == NodeStatus.RUNNING]
    for node in batch:
        node.pending_action = SOFTWARE_UPDATE
        node.registered_at = None  # Running again once its new agent registered and applied the policy
        version = plan.versions[node.group_name]
        node.status_message = f"Updating to image release {version}."
        events.move(
            session,
            node,
            NodeStatus.SYSTEM_UPDATING,
            ids=ids,
            now=now,
            cluster=cluster,
            description=f"Node {node.id} is updating to image release {version} (batch {index + 1} of "
            f"{len(plan.batches)}): its agent stops (after persisting its unpersisted steps to S3), its "
            "shared memory is cleared, and it starts again with the same node id.",
        )
    cluster.software_update = plan.model_copy(update={"batch": index, "done_at": None})


def _give_up(
    session: Session, cluster: Cluster, node: Node, now: datetime, launch_timeout_s: float, *, ids: Ids
) -> bool:
    """Fail an updating node whose restarted agent has not registered in time; whether it did."""
    started = node.agent_restarted_at
    if (
        node.status != NodeStatus.SYSTEM_UPDATING
        or node.pending_action is not None
        or node.registered_at is not None
        or started is None
        or now < started + timedelta(seconds=launch_timeout_s)
    ):
        return False
    fail_node(
        session,
        cluster,
        node,
        now,
        f"its agent did not register within {launch_timeout_s:g} s of its software update",
        ids=ids,
    )
    return True


def _finish_node(
    session: Session,
    cluster: Cluster,
    node: Node,
    now: datetime,
    plan: SoftwareUpdate,
    *,
    ids: Ids,
    provisioner: Provisioner,
) -> bool:
    """A SystemUpdating node whose agent is back (or, without agents, whose launch delay passed)
    runs the new release; whether it did."""
    if node.status != NodeStatus.SYSTEM_UPDATING or node.pending_action is not None:
        return False
    if provisioner.uses_agents:
        back = node.registered_at is not None and node.acked_generation >= cluster.generation
    else:
        back = provisioner.is_ready(node, now)
    if not back:
        return False
    version = plan.versions[node.group_name]
    node.image_version = version
    node.last_software_update = now
    node.status_message = None
    events.move(
        session,
        node,
        NodeStatus.RUNNING,
        ids=ids,
        now=now,
        cluster=cluster,
        description=f"Node {node.id} is Running on image release {version}.",
    )
    return True
