"""The console's routes without a browser: the static files and the root page, the overview routes
(``GET /overview``, ``GET /clusters/{name}/overview``) with their ETags and 304s and their OpenAPI
documentation, what the gate lets through with auth on, and the restore plan of the map."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from hyperpod_sim.domain.checkpoints.listing import NamespaceCheckpoints, StepLocation
from hyperpod_sim.domain.overview import held_bytes, restore_plan
from hyperpod_sim.sdk.auth import bearer_token
from tests.conftest import EKS, ControlPlane, group, wait_for


def create(plane: ControlPlane, name: str, count: int = 2, **extra: Any) -> None:
    body = {"ClusterName": name, "InstanceGroups": [group(count=count)], **extra}
    response = httpx.post(f"{plane.url}/clusters", json=body)
    assert response.status_code == 200, response.text


def test_the_page_and_its_files_are_served_from_the_package(control_plane: ControlPlane) -> None:
    page = httpx.get(f"{control_plane.url}/console")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert '<script type="module" src="/console/app.js">' in page.text
    for name, kind in [
        ("app.js", "text/javascript"),
        ("views.js", "text/javascript"),
        ("style.css", "text/css"),
    ]:
        asset = httpx.get(f"{control_plane.url}/console/{name}")
        assert asset.status_code == 200, name
        assert asset.headers["content-type"].startswith(kind)
    # Only the packaged files: nothing is read from the path.
    missing = httpx.get(f"{control_plane.url}/console/..%2Fapp.py")
    assert missing.status_code == 404
    assert missing.json()["__type"] == "UnknownOperationException"
    root = httpx.get(f"{control_plane.url}/")
    assert root.status_code == 200
    assert 'href="/console"' in root.text
    assert 'href="/docs"' in root.text


def test_overview_answers_304_until_something_changes(control_plane: ControlPlane) -> None:
    url = f"{control_plane.url}/overview"
    empty = httpx.get(url)
    assert empty.json() == {"Clusters": []}
    etag = empty.headers["etag"]
    assert httpx.get(url, headers={"If-None-Match": etag}).status_code == 304

    create(control_plane, "watched", 2, Orchestrator=EKS, TieredStorageConfig={"Mode": "Enable"})

    def with_its_nodes() -> tuple[httpx.Response, dict[str, Any]] | None:
        # The reconciler adds the nodes in its first pass after CreateCluster: wait for them.
        answer = httpx.get(url, headers={"If-None-Match": etag})
        assert answer.status_code == 200  # the cluster is there at once: never 304 again
        (summary,) = answer.json()["Clusters"]
        return (answer, summary) if summary["InstanceGroups"][0]["CurrentCount"] == 2 else None

    changed, summary = wait_for(with_its_nodes, what="the overview listing the cluster's two nodes")
    assert changed.headers["etag"] != etag
    assert summary["ClusterName"] == "watched"
    assert summary["ClusterStatus"] == "Creating"
    assert summary["Orchestrator"] == "Eks"
    assert summary["TieredStorageConfig"] == {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20}
    assert summary["NodeCounts"] == {"Pending": 2}
    assert summary["InstanceGroups"] == [
        {
            "InstanceGroupName": "workers",
            "InstanceType": "ml.p5.48xlarge",
            "TargetCount": 2,
            "CurrentCount": 2,
        }
    ]
    assert (summary["AppliedPolicyGeneration"], summary["DesiredPolicyGeneration"]) == (0, 1)


def test_cluster_overview_has_the_ring_the_budgets_and_the_events(control_plane: ControlPlane) -> None:
    create(control_plane, "ringed", 3, Orchestrator=EKS, TieredStorageConfig={"Mode": "Enable"})
    sm = control_plane.client()
    control_plane.settle(sm, "ringed")
    view = httpx.get(f"{control_plane.url}/clusters/ringed/overview")
    assert view.status_code == 200
    body = view.json()
    assert body["ClusterStatus"] == "InService"
    assert body["NodeCounts"] == {"Running": 3}
    nodes = body["Nodes"]
    assert [n["RingPosition"] for n in nodes] == [0, 1, 2]
    ids = [n["InstanceId"] for n in nodes]
    # One replica each, on the next node of the ring.
    assert [n["ReplicaPeers"] for n in nodes] == [[ids[1]], [ids[2]], [ids[0]]]
    # 20 % of an ml.p5.48xlarge's 2 TiB, at the default memory scale of 1/1024.
    assert {n["MemoryBudgetBytes"] for n in nodes} == {int(2048 * 2**30 * 0.2 / 1024)}
    assert body["CheckpointPolicy"]["ReplicationFactor"] == 1
    assert body["Checkpoints"] == []
    assert body["Faults"] == []
    assert body["Events"][0]["Description"].startswith("Cluster is InService")
    assert httpx.get(view.url, headers={"If-None-Match": view.headers["etag"]}).status_code == 304

    unknown = httpx.get(f"{control_plane.url}/clusters/nope/overview")
    assert unknown.status_code == 404
    assert unknown.json() == {"__type": "ResourceNotFound", "message": "Cluster 'nope' does not exist."}


def test_the_overview_routes_are_in_the_openapi_document(control_plane: ControlPlane) -> None:
    document = httpx.get(f"{control_plane.url}/openapi.json", timeout=60).json()
    for path, model in [("/overview", "ClustersOverview"), ("/clusters/{name}/overview", "ClusterOverview")]:
        answers = document["paths"][path]["get"]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert "304" in answers
    nodes = document["components"]["schemas"]["NodeView"]["properties"]
    assert {"RingPosition", "ReplicaPeers", "MemoryHeldBytes", "MemoryBudgetBytes"} <= set(nodes)
    steps = document["components"]["schemas"]["StepView"]["properties"]
    assert {"S3", "S3WrittenBy", "Complete"} <= set(steps)  # as the checkpoint listing has them
    # Static files are not API.
    assert "/console" not in document["paths"]


class TestWithAuthOn:
    @pytest.fixture
    def settings_overrides(self) -> dict[str, Any]:
        return {"auth": {"credentials": {"AKIDCONSOLE": "console-secret"}}}

    def test_the_page_is_open_and_its_data_is_not(self, control_plane: ControlPlane) -> None:
        for path in ("/", "/console", "/console/app.js", "/console/api.js"):
            assert httpx.get(control_plane.url + path).status_code == 200, path
        for method, path in [
            ("GET", "/overview"),
            ("GET", "/clusters/c/overview"),
            ("POST", "/console"),  # only GET and HEAD of the page pass
            ("POST", "/"),
        ]:
            response = httpx.request(method, control_plane.url + path)
            assert response.status_code in (401, 403), (method, path, response.status_code)
            assert response.json()["__type"] == "MissingAuthenticationToken"
        token = bearer_token("AKIDCONSOLE", "console-secret")
        answer = httpx.get(f"{control_plane.url}/overview", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200
        assert answer.json() == {"Clusters": []}


def test_restore_plan_reads_memory_then_a_replica_then_s3() -> None:
    namespace = NamespaceCheckpoints(
        "job",
        3,
        3,
        [
            StepLocation(step=9, memory={0: "i-a"}, replica={}, on_s3=False, complete=False),
            StepLocation(step=8, memory={0: "i-a"}, replica={1: ["i-b", "i-c"]}, on_s3=True, complete=True),
        ],
    )
    assert restore_plan(namespace) == {
        "Step": 8,
        "Ranks": {
            "0": {"Tier": "Memory", "InstanceId": "i-a"},
            "1": {"Tier": "Replica", "InstanceId": "i-b"},
            "2": {"Tier": "S3", "InstanceId": None},
        },
    }
    assert restore_plan(NamespaceCheckpoints("job", 1, 3, [namespace.steps[0]])) is None


def test_held_bytes_from_the_agents_metrics() -> None:
    text = "# HELP hpsim_tier_bytes_held Bytes held\n# TYPE hpsim_tier_bytes_held gauge\n"
    text += "hpsim_tier_bytes_held 4096\n"
    assert held_bytes(text) == 4096
    assert held_bytes("hpsim_tier_bytes_held_total 1\n") is None
