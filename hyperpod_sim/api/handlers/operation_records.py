"""Handlers of DescribeClusterOperation and ListClusterOperations (records: domain/operation_records.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyperpod_sim.api.deps import Params, Services
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.models import Cluster, ClusterOperation
from hyperpod_sim.models.values import WireValue


def _summary(cluster: Cluster, operation: ClusterOperation) -> dict[str, Any]:
    return {
        "OperationId": operation.id,
        "ClusterArn": cluster.arn,
        "Type": operation.type,
        "Status": operation.status,
        "CreationTime": operation.creation_time,
    }


def describe_cluster_operation(services: Services, p: Params) -> dict[str, Any]:
    cluster, operation = operations.describe_operation(
        services.db, name=p["ClusterName"], operation_id=p["OperationId"]
    )
    details = operation.details
    return {
        **_summary(cluster, operation),
        "ScalingDetails": _wire(details.scaling_details),
        "DeepHealthCheckDetails": _wire(details.deep_health_check_details),
    }


def _wire(values: Sequence[WireValue] | None) -> list[dict[str, Any]] | None:
    return None if values is None else [value.wire() for value in values]


def list_cluster_operations(services: Services, p: Params) -> dict[str, Any]:
    cluster, page = operations.list_operations(
        services.db,
        name=p["ClusterName"],
        status=p.get("Status"),
        type=p.get("Type"),
        creation_time_after=p.get("CreationTimeAfter"),
        creation_time_before=p.get("CreationTimeBefore"),
        sort_order=p.get("SortOrder"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    return {
        "ClusterOperationSummaries": [_summary(cluster, operation) for operation in page.items],
        "NextToken": page.next_token,
    }
