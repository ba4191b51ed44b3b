"""DatabaseOutage (REST ``/faults``): the control plane's database made unreachable for a while.

What a user of the service must see: AWS-shaped 503 answers while it lasts, no half-written
cluster from the operations it interrupted, and a service that recovers by itself, with nodes that
are not failed for the heartbeats the outage swallowed. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError
from sqlalchemy.exc import OperationalError

from hyperpod_sim.domain.cluster_reads import describe
from hyperpod_sim.domain.errors import ResourceNotFound
from hyperpod_sim.models.db import Database, Timeouts
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import EKS, ControlPlane, group, wait_for
from tests.faults import descriptions, node_status
from tests.helpers import hpsim, ok
from tests.tier import cluster


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """The creates below run as fast as the machine allows: no cluster limit in their way."""
    return {"limits": {"max_clusters": 100_000}}


def outage_over(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_an_outage_answers_503_and_keeps_every_cluster_whole(control_plane: ControlPlane, sm: Any) -> None:
    sm.create_cluster(ClusterName="kept", InstanceGroups=[group(count=2)], Orchestrator=EKS)
    control_plane.settle(sm, "kept")
    answered: dict[str, str] = {}  # cluster name -> "created" | the error code
    stop = threading.Event()
    failures: list[BaseException] = []

    def create_clusters(worker: int) -> None:
        client = control_plane.client()
        for index in range(10_000):
            if stop.is_set():
                return
            name = f"c{worker}-{index}"
            try:
                client.create_cluster(
                    ClusterName=name,
                    InstanceGroups=[group("a", 2), group("b", 1, "ml.m5.xlarge")],
                    Orchestrator=EKS,
                    TieredStorageConfig={"Mode": "Enable"},
                )
                answered[name] = "created"
            except ClientError as exc:
                answered[name] = exc.response["Error"]["Code"]
            except BaseException as exc:
                failures.append(exc)
                return

    workers = [threading.Thread(target=create_clusters, args=(n,)) for n in range(2)]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: len(answered) >= 4, timeout=30, what="creates before the outage")
        with HyperPodClient(control_plane.url) as client:
            # Long enough to outlast the checks below however slow the machine is; cleared after.
            fault = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=600)
            assert fault["Type"] == "DatabaseOutage"
            assert fault["EndsAt"] == pytest.approx(fault["InjectedAt"] + 600)
            assert [f["FaultId"] for f in client.list_control_plane_faults()] == [fault["FaultId"]]
            # Every transport answers in the AWS error shape.
            with pytest.raises(ClientError) as refused:
                sm.describe_cluster(ClusterName="kept")
            assert refused.value.response["Error"]["Code"] == "ServiceUnavailable"
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            rest = httpx.get(f"{control_plane.url}/clusters/kept")
            assert rest.status_code == 503
            assert rest.json()["__type"] == "ServiceUnavailable"
            assert rest.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
            assert httpx.get(f"{control_plane.url}/health").status_code == 503
            wait_for(lambda: "ServiceUnavailable" in answered.values(), timeout=30, what="a create refused")
            # Once it ends, creates succeed again.
            client.clear_control_plane_fault(fault["FaultId"])
            assert outage_over(control_plane.url)
            after = len(answered)
            wait_for(
                lambda: [v for v in list(answered.values())[after:] if v == "created"],
                timeout=30,
                what="creates after the outage",
            )
            assert client.list_control_plane_faults() == []
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert not failures, failures
    assert set(answered.values()) <= {"created", "ServiceUnavailable"}, answered

    # A create answered 503 left nothing; one answered 200 is whole, with both its groups.
    created = {name for name, outcome in answered.items() if outcome == "created"}
    with HyperPodClient(control_plane.url) as client:
        listed = {c["ClusterName"] for c in client.list_clusters()}
        assert listed == created | {"kept"}
        what = "DatabaseOutage (every database request fails, for 600 s)"
        injected = f"Fault {fault['FaultId']} injected: {what}"
        assert any(t.startswith(injected) for t in descriptions(client, "kept"))
        ended = f"Fault {fault['FaultId']} ended: {what}; cleared."
        wait_for(
            lambda: any(t.startswith(ended) for t in descriptions(client, "kept")),
            timeout=30,
            what="the end event",
        )
        # An outage also ends by itself once its duration has passed (nothing is checked while
        # it lasts: that would race its 1 s).
        brief = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=1)
        wait_for(lambda: outage_over(control_plane.url), timeout=30, what="the database back")
        ended = f"Fault {brief['FaultId']} ended: DatabaseOutage (every database request fails, for 1 s); "
        wait_for(
            lambda: any(t.startswith(ended + "its 1 s passed.") for t in descriptions(client, "kept")),
            timeout=30,
            what="the end event of the brief outage",
        )
        assert client.list_control_plane_faults() == []
    for name in created:
        described = sm.describe_cluster(ClusterName=name)
        groups = {g["InstanceGroupName"]: g["TargetCount"] for g in described["InstanceGroups"]}
        assert groups == {"a": 2, "b": 1}, (name, described)


def test_agents_ride_out_an_outage_and_it_can_be_cleared(agent_plane: ControlPlane) -> None:
    sm = agent_plane.client()
    nodes = cluster(sm, agent_plane, "steady", 2)
    with HyperPodClient(agent_plane.url) as client:
        # Cleared by the test once it has lasted longer than the heartbeat timeout (3 s): the
        # heartbeats it swallows must not fail a node.
        fault = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=600)
        with pytest.raises(ClusterError) as refused:
            client.describe_cluster("steady")
        assert refused.value.code == "ServiceUnavailable"
        wait_for(
            lambda: time.time() > fault["InjectedAt"] + 4, timeout=30, what="the heartbeat timeout to pass"
        )
        client.clear_control_plane_fault(fault["FaultId"])
        assert outage_over(agent_plane.url)
        ended = f"Fault {fault['FaultId']} ended: DatabaseOutage"
        wait_for(
            lambda: any(t.startswith(ended) for t in descriptions(client, "steady")),
            timeout=30,
            what="the end event",
        )
        # Heartbeats get through again, and no node was failed for the missed ones.
        before = {n["InstanceId"]: n["AgentStatus"]["LastHeartbeatTime"] for n in client.list_nodes("steady")}
        wait_for(
            lambda: all(
                n["AgentStatus"]["LastHeartbeatTime"] > before[n["InstanceId"]]
                for n in client.list_nodes("steady")
            ),
            timeout=30,
            what="heartbeats again",
        )
        assert all(node_status(client, "steady", n["InstanceId"]) == "Running" for n in nodes)
        texts = descriptions(client, "steady")
        assert not any(" failed: " in t for t in texts), texts

        # Cleared before its time: the service answers at once.
        long = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=600)
        with pytest.raises(ClusterError) as twice:
            client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=5)
        assert twice.value.code == "ConflictException"
        cleared = client.clear_control_plane_fault(long["FaultId"])
        assert cleared["ClearedAt"] < long["EndsAt"]
        assert client.describe_cluster("steady")["ClusterStatus"] == "InService"
        assert any(
            t.startswith(f"Fault {long['FaultId']} ended: DatabaseOutage") and "; cleared." in t
            for t in descriptions(client, "steady")
        )
        with pytest.raises(ClusterError) as gone:
            client.clear_control_plane_fault(long["FaultId"])
        assert gone.value.code == "ResourceNotFound"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_bad_control_plane_faults_are_refused(control_plane: ControlPlane) -> None:
    def refused(body: Any) -> str:
        response = httpx.post(f"{control_plane.url}/faults", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["__type"] == "ValidationException"
        message: str = response.json()["message"]
        return message

    assert "Member must not be null" in refused({"Type": "DatabaseOutage"})
    assert "less than or equal to 3600" in refused({"Type": "DatabaseOutage", "DurationSeconds": 4000})
    assert "[DatabaseOutage, DatabaseHang]" in refused({"Type": "AgentCrash", "DurationSeconds": 5})
    assert "Unknown member 'InstanceId'" in refused(
        {"Type": "DatabaseOutage", "DurationSeconds": 5, "InstanceId": "i-1"}
    )
    assert httpx.delete(f"{control_plane.url}/faults/f-0123456789abcdef").status_code == 404


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_cli_starts_shows_and_ends_an_outage(control_plane: ControlPlane) -> None:
    url = control_plane.url
    quiet = "The control plane's database answers: no DatabaseOutage in force.\n"
    assert ok(hpsim(url, "fault", "database")) == quiet
    started = ok(hpsim(url, "fault", "database", "--duration", "600"))
    fault_id = started.split()[0]
    assert started.startswith(f"{fault_id} (DatabaseOutage) until ")
    assert httpx.get(f"{url}/health").status_code == 503
    assert ok(hpsim(url, "fault", "database")).startswith(f"{fault_id} (DatabaseOutage) until ")
    assert ok(hpsim(url, "fault", "database", "--end")) == f"{fault_id} (DatabaseOutage) cleared\n"
    assert httpx.get(f"{url}/health").status_code == 200
    assert ok(hpsim(url, "fault", "database")) == quiet


def test_no_free_connection_for_describe_cluster_is_an_outage_not_a_crash(tmp_path: Path) -> None:
    """DescribeCluster reads through a Core connection of its own: with every pooled connection
    held (1,024 agents registering at once did it), it fails as every read does, with the
    OperationalError the API answers 503 ServiceUnavailable, and the outage is noted."""
    db = Database(f"sqlite:///{tmp_path / 'db.sqlite'}", timeouts=Timeouts(pool_s=0.1))
    db.migrate()
    held = [db.engine.connect() for _ in range(16 + 10)]  # the pool's size and overflow
    try:
        with pytest.raises(OperationalError, match="no database connection came free"):
            describe(db, "any")
        assert db.unavailable_ago() is not None
    finally:
        for conn in held:
            conn.close()
    with pytest.raises(ResourceNotFound):  # answers again once a connection is free
        describe(db, "any")
