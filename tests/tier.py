"""The agents' in-memory checkpoint tier over its HTTP protocol (the one the
amzn-sagemaker-checkpointing library speaks): a tiered cluster and its agents' endpoints, shards
in and out, namespaces, metrics. Plain functions the tier's test modules share."""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol

import httpx
import xxhash

from tests.conftest import EKS, ROLE, wait_for


def meta(data: bytes) -> str:
    return json.dumps(
        {"checksum": base64.b64encode(xxhash.xxh3_128(data).digest()).decode(), "algorithm": "xxh3_128"}
    )


class Reachable(Protocol):
    """A control plane the tests reach at ``url``: a ControlPlane or a ServerProcess."""

    @property
    def url(self) -> str: ...


def cluster(sm: Any, plane: Reachable, name: str, count: int, instance_type: str = "ml.p5.48xlarge",
            percentage: int = 20, recovery: str = "Automatic") -> list[dict[str, Any]]:  # fmt: skip
    """A tiered-storage cluster, InService; its nodes' details (with agent endpoints) in ring order."""
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": instance_type,
                "InstanceCount": count,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
        NodeRecovery=recovery,
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=90,
        what="InService",
    )
    return members(plane, name)


def members(plane: Reachable, name: str) -> list[dict[str, Any]]:
    listing = httpx.get(f"{plane.url}/clusters/{name}/nodes").json()["ClusterNodeSummaries"]
    return [n for n in listing if n.get("AgentStatus", {}).get("Endpoint")]


def url(node: dict[str, Any]) -> str:
    return str(node["AgentStatus"]["Endpoint"])


def put(agent: str, ns: str, rank: int, step: int, data: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{agent}/v1/cp/checkpoints/{ns}/{rank}/{step}",
        content=data,
        headers={"Shard-Meta": meta(data), **headers},
    )


def get(agent: str, ns: str, rank: int, step: int) -> httpx.Response:
    return httpx.get(f"{agent}/v1/cp/checkpoints/{ns}/{rank}/{step}")


def latest(agent: str, ns: str, limit: int = 5) -> list[int]:
    response = httpx.get(f"{agent}/v1/cp/checkpoints/{ns}/latest", params={"limit": limit})
    assert response.status_code == 200, response.text
    steps: list[int] = response.json()
    return steps


def create_namespace(agent: str, ns: str, num_ranks: int, steps_retained: int = 3) -> httpx.Response:
    return httpx.post(
        f"{agent}/v1/cp/namespaces/{ns}", params={"num_ranks": num_ranks, "steps_retained": steps_retained}
    )


def metric(agent: str, name: str) -> float:
    for line in httpx.get(f"{agent}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def replicated(agent: str) -> bool:
    return metric(agent, "hpsim_tier_replication_pending") == 0
