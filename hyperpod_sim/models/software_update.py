"""The node operations' values: a software update's request and progress, a deep health check's
request, and what a cluster operation record holds (hyperpod_sim/domain/node_operations/software_update.py,
health_checks.py, operations.py).

Members are declared in the order of botocore's shapes: the API's validation rebuilds a request in
that order, so a value dumps to the very JSON the request (and the rows stored before these values
existed) held.
"""

from __future__ import annotations

from typing import Any

from pydantic import SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from hyperpod_sim.models.values import WireValue


class CapacitySize(WireValue):
    """CapacitySizeConfig: ``Type`` INSTANCE_COUNT (``Value`` nodes) or CAPACITY_PERCENTAGE
    (``Value`` percent of the nodes being updated)."""

    type: str
    value: int


class RollingUpdatePolicy(WireValue):
    """RollingDeploymentPolicy. RollbackMaximumBatchSize is kept, never used: no update rolls back."""

    maximum_batch_size: CapacitySize
    rollback_maximum_batch_size: CapacitySize | None = None


class RollbackAlarm(WireValue):
    """AlarmDetails: a CloudWatch alarm named for rollbacks (never watched: no CloudWatch here)."""

    alarm_name: str


class DeploymentConfig(WireValue):
    """UpdateClusterSoftware's DeploymentConfig (DeploymentConfiguration)."""

    rolling_update_policy: RollingUpdatePolicy | None = None
    wait_interval_in_seconds: int | None = None
    auto_rollback_configuration: list[RollbackAlarm] | None = None


class GroupRelease(WireValue):
    """UpdateClusterSoftwareInstanceGroupSpecification: a group to update, and to which release
    (None: the latest)."""

    instance_group_name: str
    image_release_version: str | None = None


class SoftwareUpdate(WireValue):
    """A rolling software update in progress (``Cluster.software_update``).

    ``versions``: group name -> the release it is updated to; ``batches``: node ids, batch by batch;
    ``batch``: the one being updated (-1: none started yet); ``next_batch_at`` / ``done_at``: epoch
    seconds when the next batch may start and when the current one was done (None: not yet);
    ``maximum_batch_size`` and ``alarms``: what the request gave (ActiveSoftwareUpdateConfig);
    ``batch_size``: the size of the batches planned later for the nodes left behind.

    A member set to None is stored as null, one never set is left out, as the rows written before
    this value existed had it: ``MaximumBatchSize`` null without a RollingUpdatePolicy, ``DoneAt``
    absent until the first batch starts, then null until that batch is done.
    """

    versions: dict[str, str]
    batches: list[list[str]]
    batch: int
    wait_interval_in_seconds: int
    next_batch_at: float
    maximum_batch_size: CapacitySize | None = None
    batch_size: int | None = None
    alarms: list[str] | None = None
    done_at: float | None = None

    @model_serializer(mode="wrap")
    def _keep_set_nulls(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        dumped: dict[str, Any] = handler(self)
        if not info.exclude_none:
            return dumped
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            key = field.alias if info.by_alias and field.alias else name
            if key in dumped:
                out[key] = dumped.pop(key)
            elif name in self.model_fields_set and getattr(self, name) is None:
                out[key] = None
        out.update(dumped)  # members the model does not name, as they were stored
        return out


class HealthCheckConfiguration(WireValue):
    """InstanceGroupHealthCheckConfiguration: the checks to run on a group's nodes (``instance_ids``;
    None: every Running node of it). A DeepHealthCheckDetails item of an operation record too, then
    with the nodes chosen."""

    instance_group_name: str
    instance_ids: list[str] | None = None
    deep_health_checks: list[str]


class ScalingCounts(WireValue):
    """ClusterOperationScalingConfiguration (members in the order the records always stored them)."""

    target_count: int
    current_count: int | None = None
    min_count: int | None = None


class ScalingDetail(WireValue):
    """ClusterOperationScalingDetails: one group's counts before and after a Scaling operation."""

    instance_group_name: str
    status: str
    original: ScalingCounts
    desired: ScalingCounts


class OperationDetails(WireValue):
    """What a cluster operation record holds beside its columns (``ClusterOperation.details``):
    its ScalingDetails, its DeepHealthCheckDetails, and a MoveClusterNodes request's ``Move``
    record (ClientToken, parameters, answer; kept for retries, not returned)."""

    scaling_details: list[ScalingDetail] | None = None
    deep_health_check_details: list[HealthCheckConfiguration] | None = None
    move: dict[str, Any] | None = None
