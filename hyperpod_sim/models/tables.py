"""Tables of the control plane. API shapes live in api/, not here."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from hyperpod_sim.contracts.agent_bodies import S3TierStatus
from hyperpod_sim.models.faults import Fault
from hyperpod_sim.models.groups import (
    CheckpointPolicy,
    ClusterExtra,
    InstanceGroupSpec,
    SchedulerVersion,
    TieredStorage,
)
from hyperpod_sim.models.node_sets import NodeMove
from hyperpod_sim.models.software_update import OperationDetails, SoftwareUpdate
from hyperpod_sim.models.values import ValueJSON


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite keeps no zone of its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {
        datetime: UtcDateTime(),
        dict[str, Any]: JSON,
        list[Any]: JSON,
    }


class Cluster(Base):
    __tablename__ = "clusters"

    id: Mapped[str] = mapped_column(String(12), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    arn: Mapped[str] = mapped_column(String(256), unique=True)
    status: Mapped[str] = mapped_column(String(32))
    failure_message: Mapped[str | None] = mapped_column(Text)
    creation_time: Mapped[datetime]
    updated_time: Mapped[datetime]
    node_recovery: Mapped[str] = mapped_column(String(16))
    orchestrator: Mapped[dict[str, Any] | None]
    vpc_config: Mapped[dict[str, Any] | None]
    tiered_storage: Mapped[TieredStorage | None] = mapped_column(ValueJSON(TieredStorage))
    # Members stored as given and echoed back (NodeProvisioningMode, ClusterRole, AutoScaling, ...).
    extra: Mapped[ClusterExtra] = mapped_column(ValueJSON(ClusterExtra))
    # Bumped by every change of the desired state; the reconciler works until it is observed.
    generation: Mapped[int] = mapped_column(Integer, default=1)
    # The checkpoint policy extension (domain/checkpoints/cluster_policy.py), in its wire shape; None:
    # defaults.
    checkpoint_policy: Mapped[CheckpointPolicy | None] = mapped_column(ValueJSON(CheckpointPolicy))
    # Injected faults still in force (hyperpod_sim/domain/faults.py), in their wire shape; None: none ever.
    faults: Mapped[list[Fault] | None] = mapped_column(ValueJSON(list[Fault]))
    # The rolling software update in progress (UpdateClusterSoftware,
    # domain/node_operations/software_update.py):
    # its batches of node ids, the batch being updated, when the next may start; None: none.
    software_update: Mapped[SoftwareUpdate | None] = mapped_column(ValueJSON(SoftwareUpdate))
    # Agent <-> control plane secrets (docs/agent-protocol.md).
    token: Mapped[str] = mapped_column(String(64))
    bootstrap_token: Mapped[str] = mapped_column(String(64))
    # What trainers send to the agents' checkpoint routes when AgentAccess is Token (agents get
    # only its SHA-256, in the node policy).
    checkpoint_token: Mapped[str] = mapped_column(String(64))
    # The cluster's operation in progress (domain/operation_records.py): its events carry its id.
    operation_id: Mapped[str | None] = mapped_column(String(36))

    instance_groups: Mapped[list[InstanceGroup]] = relationship(
        back_populates="cluster",
        cascade="all, delete-orphan",
        order_by="InstanceGroup.position",
    )
    nodes: Mapped[list[Node]] = relationship(
        back_populates="cluster", cascade="all, delete-orphan", order_by="Node.launch_time"
    )


class InstanceGroup(Base):
    __tablename__ = "instance_groups"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(63))
    position: Mapped[int]
    instance_type: Mapped[str] = mapped_column(String(64))
    target_count: Mapped[int]
    status: Mapped[str] = mapped_column(String(32))
    restricted: Mapped[bool] = mapped_column(default=False)
    # The group's specification as the client sent it (ExecutionRole, LifeCycleConfig, ...).
    spec: Mapped[InstanceGroupSpec] = mapped_column(ValueJSON(InstanceGroupSpec))
    # SoftwareUpdateStatus of the group's last software update (domain/node_operations/software_update.py),
    # kept until the next one; None: never updated.
    software_update_status: Mapped[str | None] = mapped_column(String(32))
    # Why its automatic node recovery stopped (hyperpod_sim/domain/nodes/recovery.py: a slot's nodes kept
    # failing before their agents registered); None: it replaces failed nodes (NodeRecovery Automatic).
    recovery_stopped: Mapped[str | None] = mapped_column(Text)

    cluster: Mapped[Cluster] = relationship(back_populates="instance_groups")


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(19), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    group_name: Mapped[str] = mapped_column(String(63))
    # Position in its group, kept by a replacement: the replica ring is ordered by it.
    slot: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    logical_id: Mapped[str] = mapped_column(String(128), unique=True)
    instance_type: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(32))
    status_message: Mapped[str | None] = mapped_column(Text)
    launch_time: Mapped[datetime]
    ready_at: Mapped[datetime]
    private_ip: Mapped[str] = mapped_column(String(15))
    # The node's own IPv4 address, for its whole life (an agent restart, a control-plane restart and
    # a reboot keep it): on the loopback network one drawn from 127.77.0.0/16, where its agent
    # listens at port 9200 (hyperpod_sim/infra/addresses.py); with external agents the host its agent
    # registered from. None: none (the shared network, an external node no agent holds yet, a row
    # from before revision 0016), and AWS's PrivatePrimaryIp shows ``private_ip`` instead.
    address: Mapped[str | None] = mapped_column(String(15), index=True)
    # The node's agent, as it registered and last reported.
    endpoint: Mapped[str | None] = mapped_column(String(256))
    pid: Mapped[int | None]
    registered_at: Mapped[datetime | None]
    last_heartbeat: Mapped[datetime | None]
    acked_generation: Mapped[int] = mapped_column(Integer, default=0)
    # Policy push bookkeeping, persisted so a restarted control plane resumes retries.
    push_attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_push_at: Mapped[datetime | None]
    push_claimed_until: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    # The agent's S3 tier as its last heartbeat reported it (docs/agent-protocol.md); None: no
    # S3 tier, or an agent that does not report one.
    s3_status: Mapped[S3TierStatus | None] = mapped_column(ValueJSON(S3TierStatus))
    # Restarts of a crashed agent on this node (domain/reconciler.py), for the restart backoff and
    # the registration deadline of a restarted agent; persisted so a restarted control plane keeps them.
    agent_restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    agent_restarted_at: Mapped[datetime | None]
    # Bounded failure loops (hyperpod_sim/domain/nodes/recovery.py), persisted so a restarted control plane
    # resumes them: attempts to start its agent that failed since it last registered (it could not be
    # spawned, or exited before registering), and when the next is due (None: none waits); how many of
    # its slot's nodes in a row failed before their agent registered (this one too once it failed),
    # handed on to its replacement.
    start_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_start_at: Mapped[datetime | None]
    failed_in_a_row: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Credentials of the node's agent (domain/nodes/credentials.py): the digest of the launch secret the
    # local provisioner handed to the agent process it started (None: not bound, or consumed), the
    # digest of the node token registration answered, and the token the control plane pushes with.
    launch_secret_hash: Mapped[str | None] = mapped_column(String(64))
    token_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    push_token: Mapped[str | None] = mapped_column(String(64))
    # The node operation in progress (domain/node_operations/reboot_replace.py): Reboot (its agent stops, its
    # shared memory is cleared, it starts again on the same node) or SoftwareUpdate; None: none.
    pending_action: Mapped[str | None] = mapped_column(String(32))
    # When the operation in progress is due (a deep health check's end).
    action_due_at: Mapped[datetime | None]
    # The image release version the node runs (UpdateClusterSoftware), and when it last changed.
    image_version: Mapped[str | None] = mapped_column(String(64))
    last_software_update: Mapped[datetime | None]
    # MoveClusterNodes under way (domain/node_operations/move.py): where the node goes and whence;
    # None once it is there.
    move: Mapped[NodeMove | None] = mapped_column(ValueJSON(NodeMove))

    cluster: Mapped[Cluster] = relationship(back_populates="nodes")


class ClusterEvent(Base):
    __tablename__ = "cluster_events"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    resource_type: Mapped[str] = mapped_column(String(16))
    instance_group_name: Mapped[str | None] = mapped_column(String(63))
    instance_id: Mapped[str | None] = mapped_column(String(19))
    event_time: Mapped[datetime] = mapped_column(index=True)
    level: Mapped[str] = mapped_column(String(8))
    description: Mapped[str] = mapped_column(Text)
    # The cluster operation in progress when it was recorded (ListClusterEvents' OperationId).
    operation_id: Mapped[str | None] = mapped_column(String(36), index=True)


class ClusterOperation(Base):
    """A cluster operation record (DescribeClusterOperation, ListClusterOperations): what a
    request started, on which nodes, and whether it is still in progress."""

    __tablename__ = "cluster_operations"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    # ClusterOperationType of the model (Scaling, DeepHealthCheck) or one of hyperpod-sim's own.
    type: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    # The API operation that started it (CreateCluster, BatchDeleteClusterNodes, ...).
    requested_by: Mapped[str] = mapped_column(String(64))
    creation_time: Mapped[datetime] = mapped_column(index=True)
    end_time: Mapped[datetime | None]
    # Node ids it acts on (empty: the cluster's groups as a whole).
    node_ids: Mapped[list[Any]]
    # Its ScalingDetails / DeepHealthCheckDetails (and a move's record), in their wire shape.
    details: Mapped[OperationDetails] = mapped_column(ValueJSON(OperationDetails))


class Tag(Base):
    __tablename__ = "tags"
    __table_args__ = (UniqueConstraint("resource_arn", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    resource_arn: Mapped[str] = mapped_column(String(256), index=True)
    key: Mapped[str] = mapped_column(String(128))
    value: Mapped[str] = mapped_column(String(256))


class CheckpointNamespace(Base):
    """A trainer's checkpoint namespace, cluster-wide: any agent of the cluster answers for it."""

    __tablename__ = "checkpoint_namespaces"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(256))
    num_ranks: Mapped[int]
    steps_retained: Mapped[int]
    created_at: Mapped[datetime]


class ClusterSchedulerConfig(Base):
    """A cluster policy of task governance (CreateClusterSchedulerConfig), with every version."""

    __tablename__ = "cluster_scheduler_configs"

    id: Mapped[str] = mapped_column(String(12), primary_key=True)
    arn: Mapped[str] = mapped_column(String(256), unique=True)
    name: Mapped[str] = mapped_column(String(63))
    # One policy per cluster (ConflictException for a second).
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), unique=True)
    status: Mapped[str] = mapped_column(String(32))
    version: Mapped[int]
    creation_time: Mapped[datetime]
    last_modified_time: Mapped[datetime]
    tags: Mapped[list[Any]]
    # Every version, oldest first.
    versions: Mapped[list[SchedulerVersion]] = mapped_column(ValueJSON(list[SchedulerVersion]))


class ClusterExtension(Base):
    """An extension installed on a cluster (CreateClusterExtension), at one version and configuration."""

    __tablename__ = "cluster_extensions"
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)

    id: Mapped[str] = mapped_column(String(12), primary_key=True)
    arn: Mapped[str] = mapped_column(String(256), unique=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    # ConfigurationValues as a JSON object (the wire carries it serialized as a string).
    configuration: Mapped[dict[str, Any] | None]
    # Creating or Updating until every live node runs it; then it reads Active.
    phase: Mapped[str] = mapped_column(String(16))
    creation_time: Mapped[datetime]
    last_modified_time: Mapped[datetime]
    tags: Mapped[list[Any]]


class ClientToken(Base):
    """A request's ClientToken (domain/client_tokens.py): what it asked, what it was answered, so
    that a retry within the token's validity gets the same answer and changes nothing."""

    __tablename__ = "client_tokens"
    __table_args__ = (UniqueConstraint("cluster_id", "operation", "token"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"))
    # The API operation (BatchAddClusterNodes, CreateClusterExtension, ...).
    operation: Mapped[str] = mapped_column(String(64))
    token: Mapped[str] = mapped_column(String(64))
    # The request's parameters that a retry must repeat, and the answer's own record.
    parameters: Mapped[dict[str, Any]]
    result: Mapped[dict[str, Any]]
    creation_time: Mapped[datetime] = mapped_column(index=True)


class NodeAttachment(Base):
    """An EBS volume or a network interface attached to a node (AttachClusterNodeVolume,
    AttachClusterNodeNetworkInterface); gone with the node (a replacement is fresh hardware)."""

    __tablename__ = "node_attachments"
    __table_args__ = (UniqueConstraint("kind", "resource_id"),)

    id: Mapped[str] = mapped_column(String(28), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    # "volume" or "network-interface".
    kind: Mapped[str] = mapped_column(String(20))
    # vol-... or eni-...
    resource_id: Mapped[str] = mapped_column(String(256))
    device_name: Mapped[str | None] = mapped_column(String(32))
    attach_time: Mapped[datetime]


class Job(Base):
    """A training job on a cluster's nodes (hyperpod_sim/domain/jobs.py): its command, its shape,
    whether it resumes by itself, and where it stands. Its ranks are processes of its supervisor
    (``hyperpod-sim job supervise``), which reports each attempt's start and end here."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(18), primary_key=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    command: Mapped[list[Any]] = mapped_column(JSON)
    node_count: Mapped[int | None] = mapped_column(Integer)  # None: every Running node at its first start
    procs_per_node: Mapped[int] = mapped_column(Integer)
    auto_resume: Mapped[bool] = mapped_column(Boolean)
    max_restarts: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    status_message: Mapped[str | None] = mapped_column(Text)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    stop_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    supervisor_pid: Mapped[int | None] = mapped_column(Integer)
    supervisor_start_time: Mapped[int | None] = mapped_column(BigInteger)
    log_path: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]

    cluster: Mapped[Cluster] = relationship()
    attempts: Mapped[list[JobAttempt]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="JobAttempt.number"
    )
    __table_args__ = (UniqueConstraint("cluster_id", "name"),)


class JobAttempt(Base):
    """One start of a job: on which nodes, how it ended and why."""

    __tablename__ = "job_attempts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    nodes: Mapped[list[Any]] = mapped_column(JSON)
    # Each node's place, "<group>/<slot>", beside ``nodes``: a replacement takes its failed node's.
    slots: Mapped[list[Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    exit_code: Mapped[int | None] = mapped_column(Integer)
    # Why it ended: NodeFailure (with the node), RankExit (with the rank), Stopped, Succeeded.
    cause: Mapped[str | None] = mapped_column(String(16))
    cause_node: Mapped[str | None] = mapped_column(String(19))
    cause_rank: Mapped[int | None] = mapped_column(Integer)

    job: Mapped[Job] = relationship(back_populates="attempts")
