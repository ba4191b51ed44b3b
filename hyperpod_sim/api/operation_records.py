"""Handlers of DescribeClusterOperation and ListClusterOperations (records: domain/operations.py)."""

from __future__ import annotations

from typing import Any

from hyperpod_sim.domain import operations
from hyperpod_sim.domain.clusters import ClusterService
from hyperpod_sim.models import Cluster, ClusterOperation


def _summary(cluster: Cluster, operation: ClusterOperation) -> dict[str, Any]:
    return {
        "OperationId": operation.id,
        "ClusterArn": cluster.arn,
        "Type": operation.type,
        "Status": operation.status,
        "CreationTime": operation.creation_time,
    }


def describe_cluster_operation(svc: ClusterService, p: dict[str, Any]) -> dict[str, Any]:
    cluster, operation = operations.describe_operation(
        svc.db, name=p["ClusterName"], operation_id=p["OperationId"]
    )
    return {
        **_summary(cluster, operation),
        "ScalingDetails": operation.details.get("ScalingDetails"),
        "DeepHealthCheckDetails": operation.details.get("DeepHealthCheckDetails"),
    }


def list_cluster_operations(svc: ClusterService, p: dict[str, Any]) -> dict[str, Any]:
    cluster, page = operations.list_operations(
        svc.db,
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
