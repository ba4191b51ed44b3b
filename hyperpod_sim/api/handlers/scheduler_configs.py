"""Handlers of the cluster scheduler config operations (domain/account/scheduler_configs.py)."""

from __future__ import annotations

from typing import Any

from hyperpod_sim.api.deps import Params, Services


def create_cluster_scheduler_config(services: Services, p: Params) -> dict[str, Any]:
    row = services.scheduler_configs.create(
        name=p["Name"],
        cluster_arn=p["ClusterArn"],
        scheduler_config=p["SchedulerConfig"],
        description=p.get("Description"),
        tags=p.get("Tags"),
    )
    return {"ClusterSchedulerConfigArn": row.arn, "ClusterSchedulerConfigId": row.id}


def update_cluster_scheduler_config(services: Services, p: Params) -> dict[str, Any]:
    row = services.scheduler_configs.update(
        config_id=p["ClusterSchedulerConfigId"],
        target_version=p["TargetVersion"],
        scheduler_config=p.get("SchedulerConfig"),
        description=p.get("Description"),
    )
    return {"ClusterSchedulerConfigArn": row.arn, "ClusterSchedulerConfigVersion": row.version}


def describe_cluster_scheduler_config(services: Services, p: Params) -> dict[str, Any]:
    found = services.scheduler_configs.describe(
        config_id=p["ClusterSchedulerConfigId"], version=p.get("ClusterSchedulerConfigVersion")
    )
    row = found.row
    return {
        "ClusterSchedulerConfigArn": row.arn,
        "ClusterSchedulerConfigId": row.id,
        "Name": row.name,
        "ClusterSchedulerConfigVersion": found.version,
        "Status": row.status,
        "StatusDetails": found.status_details,
        "ClusterArn": found.cluster_arn,
        "SchedulerConfig": found.scheduler_config,
        "Description": found.description,
        "CreationTime": row.creation_time,
        "LastModifiedTime": row.last_modified_time,
    }


def list_cluster_scheduler_configs(services: Services, p: Params) -> dict[str, Any]:
    page = services.scheduler_configs.list(
        created_after=p.get("CreatedAfter"),
        created_before=p.get("CreatedBefore"),
        name_contains=p.get("NameContains"),
        cluster_arn=p.get("ClusterArn"),
        status=p.get("Status"),
        sort_by=p.get("SortBy"),
        sort_order=p.get("SortOrder"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    return {
        "ClusterSchedulerConfigSummaries": [
            {
                "ClusterSchedulerConfigArn": row.arn,
                "ClusterSchedulerConfigId": row.id,
                "ClusterSchedulerConfigVersion": row.version,
                "Name": row.name,
                "CreationTime": row.creation_time,
                "LastModifiedTime": row.last_modified_time,
                "Status": row.status,
                "ClusterArn": cluster_arn,
            }
            for row, cluster_arn in page.items
        ],
        "NextToken": page.next_token,
    }


def delete_cluster_scheduler_config(services: Services, p: Params) -> dict[str, Any]:
    services.scheduler_configs.delete(config_id=p["ClusterSchedulerConfigId"])
    return {}
