"""The typed values of a cluster's specification: its instance groups (``InstanceGroupSpec``), its
tiered storage (``TieredStorage``), the members it stores as given (``ClusterExtra``), its tags
(``ResourceTag``), its checkpoint policy (``CheckpointPolicy``) and the versions of its task
governance policy (``SchedulerVersion``). The API builds them from the validated wire input
(CreateCluster, UpdateCluster, AddTags, PutCheckpointPolicy); the tables store them in their wire
shape (models/values.py); the domain reads their attributes.

A group's specification is kept as the client sent it, members the domain does not read included
(LifeCycleConfig, ExecutionRole, ...: extra="allow"), because DescribeCluster echoes them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from hyperpod_sim.models.values import WireValue

DEFAULT_IN_MEMORY_RETENTION = 3
DEFAULT_REPLICATION_FACTOR = 1
# Open: the agents' /v1/cp routes serve anyone who reaches them, as HyperPod's daemon trusts its
# pod network (the amzn-sagemaker-checkpointing library sends no credentials). Token: writes and
# deletes on /v1/cp, and every /v1/fast route, need the cluster's checkpoint token.
DEFAULT_AGENT_ACCESS = "Open"


class InstanceRequirements(WireValue):
    """A flexible group's instance types (ClusterInstanceRequirements), the first one preferred."""

    instance_types: tuple[str, ...]


class InstanceGroupSpec(WireValue):
    """One instance group as CreateCluster or UpdateCluster specified it (ClusterInstanceGroup-
    Specification, or its restricted twin), with what later operations changed in it
    (InstanceCount, ImageId, ImageReleaseVersion)."""

    instance_group_name: str
    instance_count: int
    # Exactly one of the two (domain/clusters/rules.py checks it).
    instance_type: str | None = None
    instance_requirements: InstanceRequirements | None = None
    min_instance_count: int | None = None
    image_id: str | None = None
    image_release_version: str | None = None
    training_plan_arn: str | None = None
    # VpcConfig (SecurityGroupIds, Subnets), the cluster's when absent.
    override_vpc_config: dict[str, Any] | None = None

    @property
    def first_instance_type(self) -> str:
        """The group's instance type: InstanceType, or the first of InstanceRequirements."""
        if self.instance_type is not None:
            return self.instance_type
        assert self.instance_requirements is not None  # one of the two (domain/clusters/rules.py)
        return self.instance_requirements.instance_types[0]

    @property
    def instance_types(self) -> tuple[str, ...]:
        """Every instance type the group may run: its InstanceRequirements, or its one type."""
        if self.instance_requirements is not None:
            return self.instance_requirements.instance_types
        return (self.first_instance_type,)


class TieredStorage(WireValue):
    """A cluster's TieredStorageConfig (ClusterTieredStorageConfig): managed tiered checkpointing
    on (Mode Enable, with the share of instance memory it may use) or off."""

    mode: str
    instance_memory_allocation_percentage: int | None = None

    @property
    def enabled(self) -> bool:
        return self.mode == "Enable"


class ClusterExtra(WireValue):
    """The cluster members stored as given and echoed back by DescribeCluster; UpdateCluster
    replaces those it names and keeps the others."""

    # Continuous: nodes may be added, moved and named by logical id (BatchAddClusterNodes, ...).
    node_provisioning_mode: str | None = None
    cluster_role: str | None = None
    auto_scaling: dict[str, Any] | None = None
    # Returned mapped to its output shape (api/handlers/members.py: restricted_config).
    restricted_instance_groups_config: dict[str, Any] | None = None

    @property
    def continuous(self) -> bool:
        return self.node_provisioning_mode == "Continuous"


class ResourceTag(WireValue):
    """One tag (Key, Value) of a resource."""

    key: str
    value: str


class CheckpointPolicy(WireValue):
    """A cluster's checkpoint policy, hyperpod-sim's extension of the cluster API (its members and
    their limits: contracts/simulator_api.json; which go together: domain/checkpoints/cluster_policy.py)."""

    # Its members are hyperpod-sim's own, all named here: a request's ClusterName is not one.
    model_config = ConfigDict(extra="ignore")

    s3_base_uri: str | None = None
    persist_every_steps: int | None = None
    persist_every_seconds: int | None = None
    s3_retention: int | None = None
    in_memory_retention: int = DEFAULT_IN_MEMORY_RETENTION
    replication_factor: int = DEFAULT_REPLICATION_FACTOR
    agent_access: str = DEFAULT_AGENT_ACCESS
    s3_layout: str | None = None  # None: the Default layout (contracts/s3layout.py)

    @classmethod
    def from_stored(cls, stored: CheckpointPolicy | None) -> CheckpointPolicy:
        """The policy a cluster's column holds; None (none was ever put): the defaults."""
        return stored if stored is not None else cls()

    @model_serializer(mode="wrap")
    def _every_member(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Every member, null where unset, S3Layout once set only: the policy's answers and its
        stored rows keep the shape they had before S3Layout existed, and before this was a value."""
        return _with_nulls(
            self, handler(self), info, [n for n in type(self).model_fields if n != "s3_layout"]
        )


class SchedulerVersion(WireValue):
    """One version of a cluster scheduler config, as its row keeps it (``versions``, oldest first)."""

    version: int
    scheduler_config: dict[str, Any]
    description: str | None
    time: float  # when it was made, epoch seconds

    @model_serializer(mode="wrap")
    def _with_description(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Description null where none was given, as the rows held it before this was a value."""
        return _with_nulls(self, handler(self), info, ["description"])


def _with_nulls(value: WireValue, dumped: Any, info: SerializationInfo, names: list[str]) -> Any:
    """``dumped`` (``value`` serialized) with the members ``names`` as null where they were left
    out (exclude_none), in the fields' order."""
    out: dict[str, Any] = {}
    for name, field in type(value).model_fields.items():
        key = field.alias if info.by_alias and field.alias else name
        if key in dumped:
            out[key] = dumped[key]
        elif name in names:
            out[key] = None
    return out
