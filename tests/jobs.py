"""Training jobs as rank processes against a cluster's agents: the real checkpointing library's
DCP job (tests/dcp_worker.py) and the SDK's (tests/sdk_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import EKS, ROLE, ControlPlane, wait_for
from tests.helpers import run_ranks


def agents(sm: Any, plane: ControlPlane, name: str, count: int) -> list[str]:
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": "ml.g5.2xlarge",  # 32 GiB: 6.4 MiB of budget at 20 % and scale 1/1024
                "InstanceCount": count,
                "ExecutionRole": ROLE,
            }
        ],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
    )
    wait_for(
        lambda: sm.describe_cluster(ClusterName=name)["ClusterStatus"] == "InService",
        timeout=90,
        what="InService",
    )
    listing = httpx.get(f"{plane.url}/clusters/{name}/nodes").json()["ClusterNodeSummaries"]
    return [n["AgentStatus"]["Endpoint"] for n in listing]


def run_job(
    tmp_path: Path,
    urls: list[str],
    world_size: int,
    namespace: str,
    steps: str,
    load_step: int | None = None,
    *,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One training job: world_size rank processes, rank r talking to urls[r % len(urls)]."""
    args = ["--steps", steps, *(() if load_step is None else ("--load-step", str(load_step))), *extra]
    return run_ranks(tmp_path, "tests.dcp_worker", urls, world_size, namespace, *args, env=env).results()


def run(
    tmp_path: Path, urls: list[str], world: int, ns: str, *args: str, expect_ok: bool = True
) -> list[dict[str, Any]]:
    """One job: ``world`` rank processes, rank r through urls[r % len(urls)]."""
    job = run_ranks(tmp_path, "tests.sdk_worker", urls, world, ns, *args, append_logs=True)
    if expect_ok:
        return job.results()
    return [json.loads(out.read_text()) for out in job.outs]
