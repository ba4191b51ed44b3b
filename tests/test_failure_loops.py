"""Issue 23, finding 4: bounded failure loops. A node whose agent cannot be started (a missing
agent command, one that is not executable, one that exits at once) is started again with a
backoff and then fails; the replacements of a slot whose nodes fail before their agent registers
stop after a limit, and the cluster says why (its FailureMessage, an event; the node its
Status.Message) instead of making nodes without end (hyperpod_sim/domain/nodes/recovery.py).

Real agent processes from the local provisioner, on a control plane whose clock the test moves
(ManualClock): the backoffs and deadlines pass when the test says, never against the machine's
speed."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyperpod_sim.api.app import create_app
from hyperpod_sim.sdk.client import ClusterError, HyperPodClient
from hyperpod_sim.settings import ProvisioningSettings
from tests.conftest import (
    EKS,
    ControlPlane,
    ManualClock,
    ServerThread,
    free_port,
    group,
    kill_processes_under,
    make_settings,
    shm_root_for,
    wait_for,
    wait_gone,
    wait_status,
)

DEFAULTS = ProvisioningSettings()
ATTEMPTS = DEFAULTS.start_attempts
LIMIT = DEFAULTS.replace_limit


def write_script(path: Path, body: str, *, mode: int) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return path


def agent_command(kind: str, tmp_path: Path) -> list[str]:
    """An agent command that cannot start an agent (``kind``), or a wrapper of the real agent that
    exits at once while the file ``broken`` beside it exists."""
    if kind == "missing":
        return [str(tmp_path / "no-such-agent")]
    if kind == "not executable":  # EACCES, as for an interpreter under another user's 0700 home
        return [str(write_script(tmp_path / "agent.sh", "exit 0", mode=0o644))]
    if kind == "exits at once":
        return [str(write_script(tmp_path / "agent.sh", "echo 'agent: bad config' >&2; exit 3", mode=0o755))]
    real = " ".join([sys.executable, "-m", "hyperpod_sim", "agent"])
    broken = tmp_path / "broken"
    wrapper = f'[ -e {broken} ] && {{ echo "agent: broken" >&2; exit 3; }}\nexec {real} "$@"'
    return [str(write_script(tmp_path / "agent.sh", wrapper, mode=0o755))]


@pytest.fixture
def plane(database_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """A control plane with real agents (local provisioner) on a ManualClock, whose agent command
    is ``request.param``'s kind (agent_command). Deadlines in manual seconds: the heartbeat timeout
    (30 s) and the launch timeout (600 s) pass only when the test moves the clock that far."""
    port = free_port()
    shm_root = shm_root_for(tmp_path)
    settings = make_settings(
        database_url,
        tmp_path / "data",
        port=port,
        provisioning={
            "mode": "local",
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 30.0,
            "launch_timeout_s": 600.0,
            "agent_command": agent_command(request.param, tmp_path),
        },
        reconciler={"interval_s": 0.2},
        simulation={"shm_root": shm_root},
    )
    clock = ManualClock()
    app = create_app(settings, clock=clock)
    try:
        with ServerThread(app, port):
            yield ControlPlane(
                url=f"http://127.0.0.1:{port}",
                services=app.state.services,
                clock=clock,
                database_url=database_url,
            )
    finally:
        kill_processes_under(tmp_path)
        shutil.rmtree(shm_root, ignore_errors=True)


def events_of(sm: Any, name: str) -> list[dict[str, Any]]:
    pages = sm.get_paginator("list_cluster_events").paginate(ClusterName=name, SortOrder="Ascending")
    return [e for page in pages for e in page["Events"]]


def nodes_in(events: list[dict[str, Any]]) -> list[str]:
    """The nodes the cluster launched, in order."""
    return [
        e["InstanceId"] for e in events if e["Description"].startswith(f"Node {e.get('InstanceId')} launched")
    ]


def agent_dirs(tmp_path: Path) -> set[str]:
    agents = tmp_path / "data" / "agents"
    return {entry.name for entry in agents.iterdir()} if agents.is_dir() else set()


def until_failure_message(
    plane: ControlPlane, sm: Any, name: str, bound: int, *, step: float
) -> dict[str, Any]:
    """Move the clock ``step`` s a poll (start backoffs, deadlines) until the cluster has a
    FailureMessage; fail at once should it launch more than ``bound`` nodes."""

    def check() -> dict[str, Any] | None:
        launched = nodes_in(events_of(sm, name))
        assert len(launched) <= bound, f"{len(launched)} nodes launched, more than {bound}"
        plane.advance(step)
        cluster: dict[str, Any] = sm.describe_cluster(ClusterName=name)
        return cluster if cluster.get("FailureMessage") else None

    found: dict[str, Any] = wait_for(check, timeout=120, what=f"cluster {name} to say why it stopped")
    return found


CAUSES = {
    "missing": "its agent could not be started: [Errno 2] No such file or directory",
    "not executable": "its agent could not be started: [Errno 13] Permission denied",
    "exits at once": "its agent exited before it registered",
}


@pytest.mark.parametrize("plane", list(CAUSES), indirect=True)
def test_an_agent_that_cannot_start_fails_its_cluster_after_a_bounded_number_of_nodes(
    plane: ControlPlane, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cause = CAUSES[request.node.callspec.params["plane"]]
    sm = plane.client()
    sm.create_cluster(
        ClusterName="loop", InstanceGroups=[group("workers", 1)], Orchestrator=EKS, NodeRecovery="Automatic"
    )
    cluster = until_failure_message(plane, sm, "loop", bound=1 + LIMIT, step=1.0)

    # The cluster's creation failed, and says why: the group, the slot, the cause.
    assert cluster["ClusterStatus"] == "Failed"
    assert cluster["InstanceGroups"][0]["Status"] == "Failed"
    message = cluster["FailureMessage"]
    assert message.startswith(
        f"Automatic node recovery of instance group 'workers' stopped: the node in its slot 0 failed "
        f"before its agent registered {LIMIT + 1} times in a row ({LIMIT} replacements), the last time "
    )
    assert cause in message

    # One node and LIMIT replacements, each started ATTEMPTS times; the last one stays failed.
    events = events_of(sm, "loop")
    launched = nodes_in(events)
    assert len(launched) == 1 + LIMIT
    (failed,) = sm.list_cluster_nodes(ClusterName="loop")["ClusterNodeSummaries"]
    assert failed["InstanceId"] == launched[-1]
    status = sm.describe_cluster_node(ClusterName="loop", NodeId=failed["InstanceId"])["NodeDetails"]
    assert status["InstanceStatus"]["Status"] == "Failure"
    assert status["InstanceStatus"]["Message"].startswith(f"Node failed: {cause}")
    assert f"(attempt {ATTEMPTS} of {ATTEMPTS}). Not replaced:" in status["InstanceStatus"]["Message"]
    retries = Counter(e["InstanceId"] for e in events if "; starting it again in " in e["Description"])
    assert retries == dict.fromkeys(launched, ATTEMPTS - 1)
    delays = [
        e["Description"].rsplit(" in ", 1)[1]
        for e in events
        if e.get("InstanceId") == launched[0] and "again in" in e["Description"]
    ]
    assert delays == ["1 s.", "2 s.", "4 s."][: ATTEMPTS - 1]  # backing off
    assert any(
        e["ResourceType"] == "Cluster" and e["Description"] == f"Cluster creation failed: {message}"
        for e in events
    )
    assert agent_dirs(tmp_path) == set(launched)

    # An hour on, the Failed cluster can be deleted; it leaves no agent directory but its nodes'.
    plane.advance(3600)
    sm.delete_cluster(ClusterName="loop")
    wait_gone(sm, "loop")
    assert agent_dirs(tmp_path) == set(launched)


@pytest.mark.parametrize("plane", ["wrapper"], indirect=True)
def test_replacements_that_die_before_registering_stop_and_an_update_resumes_them(
    plane: ControlPlane, tmp_path: Path
) -> None:
    sm = plane.client()
    sm.create_cluster(
        ClusterName="slot", InstanceGroups=[group("workers", 1)], Orchestrator=EKS, NodeRecovery="Automatic"
    )
    wait_status(sm, "slot", "InService", timeout=90)
    (first,) = sm.list_cluster_nodes(ClusterName="slot")["ClusterNodeSummaries"]

    # From now on every agent started exits at once; the node is lost.
    (tmp_path / "broken").touch()
    with HyperPodClient(plane.url) as client:
        client.inject_fault("slot", Type="NodeLoss", InstanceId=first["InstanceId"])
    cluster = until_failure_message(plane, sm, "slot", bound=2 + LIMIT, step=1.0)

    # The cluster stays InService and says why its group's nodes are not replaced any more.
    assert cluster["ClusterStatus"] == "InService"
    assert (
        f"the node in its slot 0 failed before its agent registered {LIMIT + 1} times in a row"
        in cluster["FailureMessage"]
    )
    assert "its agent exited before it registered" in cluster["FailureMessage"]
    events = events_of(sm, "slot")
    launched = nodes_in(events)
    assert launched[0] == first["InstanceId"]  # the lost node, then the loop's
    assert len(launched) == 2 + LIMIT
    (stuck,) = sm.list_cluster_nodes(ClusterName="slot")["ClusterNodeSummaries"]
    assert (stuck["InstanceId"], stuck["InstanceStatus"]["Status"]) == (launched[-1], "Failure")
    assert any(
        e["ResourceType"] == "Cluster" and e["Description"] == cluster["FailureMessage"] for e in events
    )
    assert agent_dirs(tmp_path) == set(launched)

    # The agent is mended; UpdateCluster naming the group resumes the recovery.
    (tmp_path / "broken").unlink()
    sm.update_cluster(ClusterName="slot", InstanceGroups=[group("workers", 1)])

    def running() -> dict[str, Any] | None:
        plane.advance(0.2)
        cluster: dict[str, Any] = sm.describe_cluster(ClusterName="slot")
        nodes = sm.list_cluster_nodes(ClusterName="slot")["ClusterNodeSummaries"]
        ok = cluster["ClusterStatus"] == "InService" and [n["InstanceStatus"]["Status"] for n in nodes] == [
            "Running"
        ]
        return cluster if ok else None

    cluster = wait_for(running, timeout=90, what="the replacement Running")
    assert "FailureMessage" not in cluster
    descriptions = [e["Description"] for e in events_of(sm, "slot")]
    assert "Automatic node recovery of instance group 'workers' resumes (UpdateCluster)." in descriptions
    assert f"Node {stuck['InstanceId']} is replaced by " in " ".join(descriptions)


@pytest.mark.parametrize("plane", ["wrapper"], indirect=True)
def test_silence_after_a_database_outage_counts_on_the_control_planes_clock(plane: ControlPlane) -> None:
    """Silence while the database did not answer fails no node: heartbeat deadlines count from the
    outage's end, placed on the control plane's own clock. This one is injected and starts in
    January, before the wall clock: a node lost after an outage still fails once its heartbeat
    timeout (30 s) has passed on it. (When the database gave the outage's end as a wall-clock time,
    no deadline on this clock ever passed after one: the test above hung in a loaded CI run
    whenever a statement had waited longer than 2 s, which counts as a stall.)"""
    sm = plane.client()
    sm.create_cluster(
        ClusterName="after", InstanceGroups=[group("workers", 1)], Orchestrator=EKS, NodeRecovery="None"
    )
    wait_status(sm, "after", "InService", timeout=90)
    (node,) = sm.list_cluster_nodes(ClusterName="after")["ClusterNodeSummaries"]
    with HyperPodClient(plane.url) as client:
        fault = client.inject_control_plane_fault(Type="DatabaseOutage", DurationSeconds=600)
        with pytest.raises(ClusterError) as refused:
            client.describe_cluster("after")
        assert refused.value.code == "ServiceUnavailable"
        client.clear_control_plane_fault(fault["FaultId"])
        client.inject_fault("after", Type="NodeLoss", InstanceId=node["InstanceId"])

    def failed() -> dict[str, Any] | None:
        plane.advance(1.0)
        details = sm.describe_cluster_node(ClusterName="after", NodeId=node["InstanceId"])["NodeDetails"]
        status: dict[str, Any] = details["InstanceStatus"]
        return status if status["Status"] == "Failure" else None

    status = wait_for(failed, timeout=120, what="the lost node failed on the control plane's clock")
    assert "no heartbeat from its agent for 30 s" in status["Message"]
