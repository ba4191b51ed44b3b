"""The agents' S3 tier as a test sees it: the dummy credentials and the proxy the agents reach
moto's S3 through, the checkpoint policy that turns the tier on, the objects and commit markers in
a bucket, a step saved through the agents. Its fixtures (moto, the proxy, a bucket) are in
tests/plugins/s3.py."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane, wait_for
from tests.s3proxy import FaultyS3Proxy
from tests.tier import put

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def s3_through_proxy(proxy: FaultyS3Proxy, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Agents (children of this process) sign with dummy credentials and reach S3 through the proxy."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HPSIM_AGENT_DRAIN_TIMEOUT_S", "20")
    return {"s3": {"endpoint_url": proxy.url, "embedded": False}}


def set_policy(plane: ControlPlane, sm: Any, name: str, **policy: Any) -> None:
    response = httpx.put(f"{plane.url}/clusters/{name}/checkpoint-policy", json=policy)
    assert response.status_code == 200, response.text
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=60,
        what="the policy rollout",
    )


def keys(s3: Any, bucket: str, prefix: str = "") -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {item["Key"] for page in pages for item in page.get("Contents", [])}


def markers(s3: Any, bucket: str, prefix: str) -> list[int]:
    found = keys(s3, bucket, f"{prefix}_committed/")
    return sorted(int(k.rsplit("step_", 1)[1].removesuffix(".json")) for k in found)


def save_step(nodes: list[str], ns: str, step: int, world: int, *, size: int = 50_000) -> dict[int, bytes]:
    """Every data rank through its own node's agent (rank r on node r % n), then the metadata rank
    (rank ``world``) through node 0, as DCP does: metadata last."""
    shards = {rank: os.urandom(size + rank) for rank in range(world)}
    shards[world] = f"metadata of step {step}".encode()
    for rank in range(world + 1):
        response = put(nodes[rank % len(nodes)] if rank < world else nodes[0], ns, rank, step, shards[rank])
        assert response.status_code == 200, response.text
    return shards
