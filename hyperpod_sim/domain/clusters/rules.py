"""The semantic rules of CreateCluster and UpdateCluster that botocore's shapes cannot express
(hyperpod_sim/api/shapes.py checks the shapes first): unique group names, one of InstanceType or
InstanceRequirements, TieredStorageConfig only on EKS, the instance limit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyperpod_sim.domain.errors import ResourceLimitExceeded, ValidationException
from hyperpod_sim.domain.lifecycle import GroupStatus
from hyperpod_sim.models import Cluster, InstanceGroup
from hyperpod_sim.models.groups import InstanceGroupSpec, TieredStorage

# With Mode: Enable and no percentage given, this share of instance memory is used. The API model
# allows 0..100; the HyperPod setup guide asks for 20..100; we default to its minimum.
DEFAULT_MEMORY_PERCENTAGE = 20
MIN_MEMORY_PERCENTAGE = 20


def check_groups(
    groups: Sequence[InstanceGroupSpec],
    restricted: Sequence[InstanceGroupSpec],
    existing: Sequence[str] = (),
) -> None:
    seen: set[str] = set()
    for spec in [*groups, *restricted]:
        name = spec.instance_group_name
        if name in seen:
            raise ValidationException(
                f"Instance group name '{name}' appears more than once; "
                "instance group names must be unique within a cluster."
            )
        seen.add(name)
    for spec in groups:
        if (spec.instance_type is None) == (spec.instance_requirements is None):
            raise ValidationException(
                f"Instance group '{spec.instance_group_name}' must specify exactly one of "
                "InstanceType or InstanceRequirements."
            )
        if (spec.min_instance_count or 0) > spec.instance_count:
            raise ValidationException(
                f"Instance group '{spec.instance_group_name}': MinInstanceCount "
                f"({spec.min_instance_count}) must not exceed InstanceCount ({spec.instance_count})."
            )


def check_orchestrator(orchestrator: dict[str, Any] | None) -> None:
    if orchestrator is not None and len(orchestrator) != 1:
        raise ValidationException("Orchestrator must specify exactly one of Eks or Slurm.")


def tiered_storage(tiered: TieredStorage | None, orchestrator: dict[str, Any] | None) -> TieredStorage | None:
    """Check TieredStorageConfig against the orchestrator and fill in the default percentage."""
    if tiered is None:
        return None
    if not tiered.enabled:
        return TieredStorage(mode="Disable")
    if not orchestrator or "Eks" not in orchestrator:
        raise ValidationException(
            "TieredStorageConfig with Mode 'Enable' requires an EKS-orchestrated cluster "
            "(Orchestrator.Eks); managed tiered checkpointing is available only on EKS."
        )
    percentage = tiered.instance_memory_allocation_percentage
    if percentage is None:
        percentage = DEFAULT_MEMORY_PERCENTAGE
    if not MIN_MEMORY_PERCENTAGE <= percentage <= 100:
        raise ValidationException(
            f"InstanceMemoryAllocationPercentage {percentage} is out of range: with Mode "
            f"'Enable' it must be between {MIN_MEMORY_PERCENTAGE} and 100."
        )
    return TieredStorage(mode="Enable", instance_memory_allocation_percentage=percentage)


def check_instance_limit(total: int, limit: int) -> None:
    if total > limit:
        raise ResourceLimitExceeded(
            f"The cluster would have {total} instances, over the account limit of {limit} "
            "instances per cluster."
        )


def new_group(spec: InstanceGroupSpec, position: int, *, restricted: bool) -> InstanceGroup:
    return InstanceGroup(
        name=spec.instance_group_name,
        position=position,
        instance_type=spec.first_instance_type,
        target_count=spec.instance_count,
        status=GroupStatus.CREATING,
        restricted=restricted,
        spec=spec,
    )


def check_update(
    cluster: Cluster,
    *,
    specs: Sequence[InstanceGroupSpec],
    to_delete: list[str],
    tiered: TieredStorage | None,
    orchestrator: dict[str, Any] | None,
    max_instances: int,
) -> TieredStorage | None:
    """Check an UpdateCluster of ``cluster`` (``specs``: its updated and new groups, restricted
    ones included); the tiered storage configuration it will have."""
    existing = {g.name: g for g in cluster.instance_groups}
    for group_name in to_delete:
        if group_name not in existing:
            raise ValidationException(
                f"InstanceGroupsToDelete names '{group_name}', which is not an instance "
                f"group of cluster '{cluster.name}'. Its groups are: "
                f"{', '.join(sorted(existing)) or 'none'}."
            )
        if any(s.instance_group_name == group_name for s in specs):
            raise ValidationException(
                f"Instance group '{group_name}' is both updated and deleted in one request."
            )
    for spec in specs:
        current = existing.get(spec.instance_group_name)
        if current is not None and spec.first_instance_type != current.instance_type:
            raise ValidationException(
                f"Instance group '{current.name}' has instance type {current.instance_type}; "
                f"the instance type of an existing group cannot change (requested "
                f"{spec.first_instance_type})."
            )
    effective_orchestrator = orchestrator if orchestrator is not None else cluster.orchestrator
    result = tiered_storage(tiered, effective_orchestrator) if tiered is not None else cluster.tiered_storage
    # The instance limit counts the cluster as it will be after the update.
    targets = {g.name: g.target_count for g in cluster.instance_groups}
    for group_name in to_delete:
        targets.pop(group_name)
    for spec in specs:
        targets[spec.instance_group_name] = spec.instance_count
    check_instance_limit(sum(targets.values()), max_instances)
    return result
