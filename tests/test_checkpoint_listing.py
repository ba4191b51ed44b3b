"""The control plane's checkpoint listing (``GET /clusters/{name}/checkpoints``, the SDK's
``HyperPodClient.checkpoints``) over real agents holding shards in memory, their replicas, and
steps committed on S3 (moto's server)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import ControlPlane, wait_for
from tests.s3_checkpoints import CREDENTIALS, markers, save_step, set_policy
from tests.tier import cluster, create_namespace, put, replicated, url

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def agent_settings(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Agents sign with dummy credentials for moto. Failure detection is put far away and a killed
    agent is not restarted: its node stays Running, as it does until its heartbeat timeout, so the
    listing asks it."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return {
        "s3": {"endpoint_url": moto_url, "embedded": False},
        "provisioning": {"heartbeat_timeout_s": 600.0, "restart_agents": False},
    }


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def client(agent_plane: ControlPlane) -> Iterator[HyperPodClient]:
    with HyperPodClient(agent_plane.url) as hyperpod:
        yield hyperpod


def test_listing_names_where_each_rank_is_held(
    agent_plane: ControlPlane, sm: Any, client: HyperPodClient, s3: Any, bucket: str
) -> None:
    nodes = cluster(sm, agent_plane, "where", 2, instance_type="ml.g5.2xlarge")
    a, b = (url(n) for n in nodes)
    first, second = (n["InstanceId"] for n in nodes)
    set_policy(agent_plane, sm, "where", S3BaseUri=f"s3://{bucket}/w", PersistEverySteps=2)
    assert client.checkpoints("where") == {"ClusterName": "where", "Namespaces": [], "Unreachable": []}

    assert create_namespace(a, "job", 3).status_code == 201  # two data ranks and the metadata
    assert create_namespace(b, "idle", 2, steps_retained=1).status_code == 201
    # Steps 1 and 2 whole: rank 0 and the metadata (rank 2) saved on the first node, rank 1 on the
    # second. Step 2 is due for S3 (every 2 steps). Step 3: only rank 0 arrives.
    save_step([a, b], "job", 1, 2)
    save_step([a, b], "job", 2, 2)
    assert put(a, "job", 0, 3, os.urandom(1000)).status_code == 200
    wait_for(lambda: markers(s3, bucket, "w/job/") == [2], timeout=60, what="step 2 on S3")
    wait_for(lambda: replicated(a) and replicated(b), timeout=30, what="the replicas")

    whole = {
        "Memory": {"0": first, "1": second, "2": first},
        "Replica": {"0": [second], "1": [first], "2": [second]},
        "Complete": True,
    }
    assert client.checkpoints("where") == {
        "ClusterName": "where",
        "Namespaces": [
            {"Namespace": "idle", "NumRanks": 2, "StepsRetained": 1, "Steps": []},
            {
                "Namespace": "job",
                "NumRanks": 3,
                "StepsRetained": 3,
                "Steps": [
                    {
                        "Step": 3,
                        "Memory": {"0": first},
                        "Replica": {"0": [second]},
                        "S3": False,
                        "Complete": False,
                    },
                    {"Step": 2, **whole, "S3": True},
                    {"Step": 1, **whole, "S3": False},
                ],
            },
        ],
        "Unreachable": [],
    }

    # The second node's agent dies; its node is still Running. It is named, and left out: rank 1
    # is still held, as the replica on the first node.
    for pid in find_agent_pids(second):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not answers(b), timeout=30, what="the second agent to be gone")
    survivors = {"Memory": {"0": first, "2": first}, "Replica": {"1": [first]}, "Complete": True}
    listing = client.checkpoints("where")
    assert listing["Unreachable"] == [second]
    assert listing["Namespaces"][1]["Steps"] == [
        {"Step": 3, "Memory": {"0": first}, "Replica": {}, "S3": False, "Complete": False},
        {"Step": 2, **survivors, "S3": True},
        {"Step": 1, **survivors, "S3": False},
    ]


def answers(agent: str) -> bool:
    try:
        return httpx.get(f"{agent}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_listing_of_an_unknown_cluster(agent_plane: ControlPlane, client: HyperPodClient) -> None:
    response = httpx.get(f"{agent_plane.url}/clusters/nope/checkpoints")
    assert response.status_code == 404
    assert response.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}
    with pytest.raises(ClusterError) as err:
        client.checkpoints("nope")
    assert (err.value.code, err.value.status) == ("ResourceNotFound", 404)


def test_listing_is_in_the_openapi_document(agent_plane: ControlPlane) -> None:
    operation = httpx.get(f"{agent_plane.url}/openapi.json", timeout=60).json()["paths"][
        "/clusters/{name}/checkpoints"
    ]["get"]
    assert "checkpointing" in operation["tags"]
    assert "hyperpod-sim extension" in operation["summary"]
    example = operation["responses"]["200"]["content"]["application/json"]["example"]
    assert set(example) == {"ClusterName", "Namespaces", "Unreachable"}
    assert set(example["Namespaces"][0]) == {"Namespace", "NumRanks", "StepsRetained", "Steps"}
    assert set(example["Namespaces"][0]["Steps"][0]) == {"Step", "Memory", "Replica", "S3", "Complete"}
