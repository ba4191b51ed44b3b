"""Handlers of the cluster extension operations (domain/account/cluster_extensions.py)."""

from __future__ import annotations

import json
from typing import Any

from hyperpod_sim.api.deps import Params, Services
from hyperpod_sim.domain.account import cluster_extensions
from hyperpod_sim.domain.account.cluster_extensions import ExtensionState


def create_cluster_extension(services: Services, p: Params) -> dict[str, Any]:
    row = services.cluster_extensions.create(
        cluster_arn=p["ClusterArn"],
        name=p["ExtensionName"],
        version=p.get("ExtensionVersion"),
        configuration_values=p.get("ConfigurationValues"),
        tags=p.get("Tags"),
        client_token=p.get("ClientToken"),
    )
    return {"ExtensionArn": row.arn}


def update_cluster_extension(services: Services, p: Params) -> dict[str, Any]:
    row = services.cluster_extensions.update(
        cluster_arn=p["ClusterArn"],
        arn=p["ExtensionArn"],
        version=p.get("ExtensionVersion"),
        configuration_values=p.get("ConfigurationValues"),
    )
    return {"ExtensionArn": row.arn}


def delete_cluster_extension(services: Services, p: Params) -> dict[str, Any]:
    return {
        "ExtensionArn": services.cluster_extensions.delete(cluster_arn=p["ClusterArn"], arn=p["ExtensionArn"])
    }


def _summary(state: ExtensionState) -> dict[str, Any]:
    row = state.row
    return {
        "ExtensionArn": row.arn,
        "ExtensionName": row.name,
        "ExtensionVersion": row.version,
        "Status": state.status,
        "CreationTime": row.creation_time,
    }


def describe_cluster_extension(services: Services, p: Params) -> dict[str, Any]:
    state = services.cluster_extensions.describe(cluster_arn=p["ClusterArn"], arn=p["ExtensionArn"])
    row = state.row
    details = {**_summary(state), "ClusterArn": state.cluster_arn, "LastModifiedTime": row.last_modified_time}
    if row.configuration:
        details["ConfigurationValues"] = json.dumps(row.configuration, separators=(",", ":"))
    return {
        "ExtensionDetails": details,
        "NodeSummary": {"TotalCount": state.total_nodes, "ActiveCount": state.active_nodes},
        "Health": {"Issues": []},
    }


def list_cluster_extensions(services: Services, p: Params) -> dict[str, Any]:
    page = services.cluster_extensions.list(
        cluster_arn=p["ClusterArn"],
        creation_time_after=p.get("CreationTimeAfter"),
        creation_time_before=p.get("CreationTimeBefore"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    return {"Extensions": [_summary(state) for state in page.items], "NextToken": page.next_token}


def list_cluster_extension_versions(services: Services, p: Params) -> dict[str, Any]:
    page = cluster_extensions.versions(
        name=p["ExtensionName"], max_results=p.get("MaxResults"), next_token=p.get("NextToken")
    )
    return {"ExtensionVersions": [{"ExtensionVersion": v} for v in page.items], "NextToken": page.next_token}
