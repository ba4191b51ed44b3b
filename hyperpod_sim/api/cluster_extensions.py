"""Handlers of the cluster extension operations (domain/cluster_extensions.py)."""

from __future__ import annotations

import json
from typing import Any

from hyperpod_sim.api.account_resources import Params, service_of
from hyperpod_sim.domain import cluster_extensions
from hyperpod_sim.domain.cluster_extensions import ExtensionService, ExtensionState
from hyperpod_sim.domain.clusters import ClusterService


def _service(svc: ClusterService) -> ExtensionService:
    return service_of(ExtensionService, svc)


def create_cluster_extension(svc: ClusterService, p: Params) -> dict[str, Any]:
    row = _service(svc).create(
        cluster_arn=p["ClusterArn"],
        name=p["ExtensionName"],
        version=p.get("ExtensionVersion"),
        configuration_values=p.get("ConfigurationValues"),
        tags=p.get("Tags"),
        client_token=p.get("ClientToken"),
    )
    return {"ExtensionArn": row.arn}


def update_cluster_extension(svc: ClusterService, p: Params) -> dict[str, Any]:
    row = _service(svc).update(
        cluster_arn=p["ClusterArn"],
        arn=p["ExtensionArn"],
        version=p.get("ExtensionVersion"),
        configuration_values=p.get("ConfigurationValues"),
    )
    return {"ExtensionArn": row.arn}


def delete_cluster_extension(svc: ClusterService, p: Params) -> dict[str, Any]:
    return {"ExtensionArn": _service(svc).delete(cluster_arn=p["ClusterArn"], arn=p["ExtensionArn"])}


def _summary(state: ExtensionState) -> dict[str, Any]:
    row = state.row
    return {
        "ExtensionArn": row.arn,
        "ExtensionName": row.name,
        "ExtensionVersion": row.version,
        "Status": state.status,
        "CreationTime": row.creation_time,
    }


def describe_cluster_extension(svc: ClusterService, p: Params) -> dict[str, Any]:
    state = _service(svc).describe(cluster_arn=p["ClusterArn"], arn=p["ExtensionArn"])
    row = state.row
    details = {**_summary(state), "ClusterArn": state.cluster_arn, "LastModifiedTime": row.last_modified_time}
    if row.configuration:
        details["ConfigurationValues"] = json.dumps(row.configuration, separators=(",", ":"))
    return {
        "ExtensionDetails": details,
        "NodeSummary": {"TotalCount": state.total_nodes, "ActiveCount": state.active_nodes},
        "Health": {"Issues": []},
    }


def list_cluster_extensions(svc: ClusterService, p: Params) -> dict[str, Any]:
    page = _service(svc).list(
        cluster_arn=p["ClusterArn"],
        creation_time_after=p.get("CreationTimeAfter"),
        creation_time_before=p.get("CreationTimeBefore"),
        max_results=p.get("MaxResults"),
        next_token=p.get("NextToken"),
    )
    return {"Extensions": [_summary(state) for state in page.items], "NextToken": page.next_token}


def list_cluster_extension_versions(svc: ClusterService, p: Params) -> dict[str, Any]:
    page = cluster_extensions.versions(
        name=p["ExtensionName"], max_results=p.get("MaxResults"), next_token=p.get("NextToken")
    )
    return {"ExtensionVersions": [{"ExtensionVersion": v} for v in page.items], "NextToken": page.next_token}
