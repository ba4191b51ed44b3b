"""A database that hangs (connections accepted, nothing answers) is an outage, not a reason to fail
nodes: issue 23, finding 1.

What a user of the service must see while it lasts: ``/health`` answers at once (503, saying the
database does not answer), the AWS JSON entry and the REST routes answer 503 ServiceUnavailable in
the AWS shape within their time-outs, never a hang; and once the database answers again, no node
was failed or replaced for the heartbeats the control plane could not record, every node's
in-memory checkpoints are where they were, and an agent restarted meanwhile is back in.

Two ways to hang: PostgreSQL behind a real TCP proxy that stalls (tests/tcpstall.py), and the
``DatabaseHang`` control-plane fault, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from hyperpod_sim.models import Node
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from tests.conftest import SHARED_NETWORK, ControlPlane, wait_for
from tests.faults import descriptions
from tests.helpers import hpsim, ok
from tests.tcpstall import StallingProxy
from tests.tier import cluster, create_namespace, latest, put, url

# Longer than the client's deadline on a statement (5 s statement timeout + 2 s) and than the
# heartbeat timeout (3 s): statements time out meanwhile, and every heartbeat is lost.
HANG_S = 12.0
# How long a test waits for one answer: far past every time-out of the control plane's, so that
# a request that hangs fails the test instead of passing it late.
CLIENT_TIMEOUT_S = 30.0


@pytest.fixture
def stall_proxy() -> Iterator[StallingProxy]:
    with StallingProxy(("127.0.0.1", 5432)) as proxy:
        yield proxy


@pytest.fixture
def stalling_postgres_url(postgres_url: str, stall_proxy: StallingProxy) -> str:
    """The test's PostgreSQL database, reached through the stalling proxy."""
    url = make_url(postgres_url).set(host="127.0.0.1", port=stall_proxy.port)
    return url.render_as_string(hide_password=False)


def health(plane: ControlPlane) -> httpx.Response:
    return httpx.get(f"{plane.url}/health", timeout=CLIENT_TIMEOUT_S)


def answers(plane: ControlPlane) -> bool:
    return health(plane).status_code == 200


def assert_unavailable(plane: ControlPlane, name: str) -> None:
    """Both transports answer 503 ServiceUnavailable in the AWS shape, within their time-outs."""
    rest = httpx.get(f"{plane.url}/clusters/{name}", timeout=CLIENT_TIMEOUT_S)
    assert rest.status_code == 503, rest.text
    assert rest.json()["__type"] == "ServiceUnavailable"
    assert rest.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
    aws = httpx.post(
        f"{plane.url}/",
        json={"ClusterName": name},
        headers={
            "X-Amz-Target": "SageMaker.DescribeCluster",
            "Content-Type": "application/x-amz-json-1.1",
        },
        timeout=CLIENT_TIMEOUT_S,
    )
    assert aws.status_code == 503, aws.text
    assert aws.json()["__type"] == "ServiceUnavailable"


def checkpointed(plane: ControlPlane, name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A 2-node cluster whose agents hold step 1 of namespace ``job``; its nodes and their agents."""
    sm = plane.client()
    nodes = cluster(sm, plane, name, 2)
    agents = [url(n) for n in nodes]
    assert create_namespace(agents[0], "job", 2).status_code == 201
    for rank, agent in enumerate(agents):
        assert put(agent, "job", rank, 1, os.urandom(10_000 + rank)).status_code == 200
    wait_for(lambda: all(latest(a, "job") == [1] for a in agents), timeout=30, what="step 1 complete")
    return nodes, agents


def heartbeats(client: HyperPodClient, name: str) -> dict[str, float]:
    return {n["InstanceId"]: n["AgentStatus"]["LastHeartbeatTime"] for n in client.list_nodes(name)}


def assert_nothing_failed(plane: ControlPlane, name: str, nodes: list[dict[str, Any]]) -> None:
    """Heartbeats get through again; the same nodes, Running, none failed or replaced."""
    with HyperPodClient(plane.url) as client:
        before = heartbeats(client, name)
        wait_for(
            lambda: all(beat > before[node] for node, beat in heartbeats(client, name).items()),
            timeout=60,
            what="heartbeats again",
        )
        listed = {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in client.list_nodes(name)}
        assert listed == {n["InstanceId"]: "Running" for n in nodes}
        texts = descriptions(client, name)
        assert not any(" failed: " in t or "replac" in t for t in texts), texts


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["stalling_postgres"], indirect=True)
def test_a_stalled_postgresql_fails_no_node(agent_plane: ControlPlane, stall_proxy: StallingProxy) -> None:
    nodes, agents = checkpointed(agent_plane, "steady")
    stall_proxy.stall()
    stalled_at = time.monotonic()
    # /health answers from memory at once, and soon says the database does not answer.
    wait_for(lambda: health(agent_plane).status_code == 503, timeout=CLIENT_TIMEOUT_S, what="/health 503")
    assert "does not answer" in health(agent_plane).json()["message"]
    assert_unavailable(agent_plane, "steady")
    wait_for(
        lambda: time.monotonic() > stalled_at + HANG_S, timeout=CLIENT_TIMEOUT_S, what="the hang to last"
    )
    assert_unavailable(agent_plane, "steady")
    stall_proxy.resume()
    wait_for(lambda: answers(agent_plane), timeout=60, what="the database to answer again")
    assert_nothing_failed(agent_plane, "steady", nodes)
    assert all(latest(agent, "job") == [1] for agent in agents)


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["stalling_postgres"], indirect=True)
@pytest.mark.parametrize("agent_settings", [SHARED_NETWORK], indirect=True)  # back on a new endpoint
def test_an_agent_restarted_during_a_stall_gets_back_in(
    agent_plane: ControlPlane, stall_proxy: StallingProxy
) -> None:
    nodes, agents = checkpointed(agent_plane, "steady")
    crashed = nodes[0]["InstanceId"]
    with agent_plane.services.db.read() as session:
        pid = session.get(Node, crashed).pid  # type: ignore[union-attr]
    assert pid
    stall_proxy.stall()
    stalled_at = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the agent crashes meanwhile
    wait_for(
        lambda: time.monotonic() > stalled_at + HANG_S, timeout=CLIENT_TIMEOUT_S, what="the hang to last"
    )
    stall_proxy.resume()
    wait_for(lambda: answers(agent_plane), timeout=60, what="the database to answer again")

    with HyperPodClient(agent_plane.url) as client:

        def back() -> str | None:
            node = next(n for n in client.list_nodes("steady") if n["InstanceId"] == crashed)
            endpoint = node["AgentStatus"].get("Endpoint")
            if node["InstanceStatus"]["Status"] != "Running" or endpoint in (None, agents[0]):
                return None
            try:
                httpx.get(f"{endpoint}/v1/policy", timeout=5).raise_for_status()
            except httpx.HTTPError:
                return None
            return str(endpoint)

        endpoint = wait_for(back, timeout=60, what="the restarted agent registered and answering")
    assert_nothing_failed(agent_plane, "steady", nodes)
    # The restarted agent found its node's shards in shared memory.
    assert latest(endpoint, "job") == [1]


def test_the_database_hang_fault(agent_plane: ControlPlane) -> None:
    nodes, agents = checkpointed(agent_plane, "steady")
    with HyperPodClient(agent_plane.url) as client:
        fault = client.inject_control_plane_fault(Type="DatabaseHang", DurationSeconds=600)
        assert fault["Type"] == "DatabaseHang"
        assert [f["Type"] for f in client.list_control_plane_faults()] == ["DatabaseHang"]
        refused = health(agent_plane)
        assert refused.status_code == 503
        assert "injected DatabaseHang" in refused.json()["message"]
        assert_unavailable(agent_plane, "steady")
        with pytest.raises(ClusterError) as twice:
            client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=5)
        assert twice.value.code == "ConflictException"
        wait_for(
            lambda: time.time() > fault["InjectedAt"] + HANG_S, timeout=CLIENT_TIMEOUT_S, what="the hang"
        )
        cleared = client.clear_control_plane_fault(fault["FaultId"])
        assert cleared["Type"] == "DatabaseHang"
        assert answers(agent_plane)
        ended = f"Fault {fault['FaultId']} ended: DatabaseHang ("
        texts = descriptions(client, "steady")
        assert any(t.startswith(ended) and "; cleared. " in t for t in texts), texts
    assert_nothing_failed(agent_plane, "steady", nodes)
    assert all(latest(agent, "job") == [1] for agent in agents)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_short_hang_answers_late_and_ends_by_itself(control_plane: ControlPlane, sm: Any) -> None:
    """Shorter than the client's deadline: requests wait for the hang's end and are answered."""
    with HyperPodClient(control_plane.url) as client:
        fault = client.inject_control_plane_fault(Type="DatabaseHang", DurationSeconds=2)
        assert client.list_clusters() == []  # answered, once the hang is over
        assert time.time() >= fault["EndsAt"] - 0.5
        wait_for(lambda: answers(control_plane), timeout=30, what="/health 200")
        assert client.list_control_plane_faults() == []


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_cli_starts_and_ends_a_hang(control_plane: ControlPlane) -> None:
    started = ok(hpsim(control_plane.url, "fault", "database", "--hang", "--duration", "600"))
    fault_id = started.split()[0]
    assert started.startswith(f"{fault_id} (DatabaseHang) until ")
    assert health(control_plane).status_code == 503
    assert ok(hpsim(control_plane.url, "fault", "database")).startswith(f"{fault_id} (DatabaseHang) until ")
    ended = ok(hpsim(control_plane.url, "fault", "database", "--end"))
    assert ended == f"{fault_id} (DatabaseHang) cleared\n"
    assert health(control_plane).status_code == 200
