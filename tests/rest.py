"""The REST routes over raw HTTP (httpx) as their tests use them: a boto3 result in wire form, a
cluster described and settled, its node ids."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx

from tests.conftest import ControlPlane, wait_for


def wire(value: Any) -> Any:
    """A boto3 result in wire form: datetimes as epoch seconds, ResponseMetadata dropped."""
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, dict):
        return {k: wire(v) for k, v in value.items() if k != "ResponseMetadata"}
    if isinstance(value, list):
        return [wire(v) for v in value]
    return value


def describe(http: httpx.Client, name: str) -> dict[str, Any]:
    response = http.get(f"/clusters/{name}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def settle(control_plane: ControlPlane, http: httpx.Client, name: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        control_plane.advance(60)
        body = describe(http, name)
        return body if body["ClusterStatus"] == "InService" else None

    result: dict[str, Any] = wait_for(check, what=f"cluster {name} to be InService")
    return result


def node_ids(http: httpx.Client, name: str) -> list[str]:
    response = http.get(f"/clusters/{name}/nodes")
    assert response.status_code == 200, response.text
    return [n["InstanceId"] for n in response.json()["ClusterNodeSummaries"]]
