"""The control plane's restart is invisible to nodes and their checkpoints (README, "What a restart
keeps"): ``hyperpod-sim serve`` as a real process, stopped each way a user stops it (Ctrl+C, which
the terminal sends to its whole process group; SIGTERM to its pid; SIGKILL, as a crash), then
started again on the same database, with real agent processes, a trainer that checkpoints through
the SDK (``dcp.save``, world size 1, in this process) and moto's S3 server in this process (it is
not what restarts here).

Nodes are failed after 3 s without a heartbeat, and each restart keeps the control plane down for
longer than that, so that a node failed for the silence would show.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from torch.distributed.checkpoint import save

from hyperpod_sim.domain.reconciler import Reconciler
from hyperpod_sim.infra.processes import find_agent_pids
from hyperpod_sim.sdk.checkpoint import Loaded, TieredCheckpointConfig, TieredStorageWriter, load_latest
from hyperpod_sim.sdk.client import HyperPodClient
from tests.conftest import (
    EKS,
    ControlPlane,
    ServerProcess,
    group,
    kill_processes_under,
    shm_root_for,
    wait_for,
)
from tests.s3_checkpoints import CREDENTIALS, keys, markers
from tests.sdk_worker import same, training_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

HEARTBEAT_TIMEOUT_S = 3.0
NS = "job"
GATED_AGENT = [sys.executable, str(Path(__file__).resolve().parent / "gated_agent.py"), "agent"]
LINGERING_AGENT = [sys.executable, str(Path(__file__).resolve().parent / "lingering_agent.py"), "agent"]


def agent_env(moto_url: str) -> dict[str, str]:
    return {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
        "HPSIM_RECONCILER__INTERVAL_S": "0.2",
        "HPSIM_S3__ENDPOINT_URL": moto_url,
        # Agents retry a control plane that does not answer every 0.5 s at most (2 s by default,
        # against a 10 s heartbeat timeout): once it is back, they are heard well within 3 s.
        "HPSIM_AGENT_REGISTER_BACKOFF_MAX_S": "0.5",
        **CREDENTIALS,
    }


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """The control plane's data dir (its shared memory goes with the test: tests/conftest.py);
    whatever it left running is killed after the test."""
    yield tmp_path
    kill_processes_under(tmp_path)


# ---------------------------------------------------------------------- the trainer


def config_for(agent: str) -> TieredCheckpointConfig:
    return TieredCheckpointConfig(namespace=NS, world_size=1, agent_url=agent)


def checkpoint(agent: str, step: int) -> None:
    save(training_state(step, 0), storage_writer=TieredStorageWriter(config_for(agent), step=step))


def resume(agent: str) -> Loaded:
    """``load_latest`` into a state of the same shape: exactly the state saved at the step it says."""
    state = training_state(987, 0)
    loaded = load_latest(state, config_for(agent))
    assert same(state, training_state(loaded.step, 0)), f"step {loaded.step} came back altered"
    return loaded


# ---------------------------------------------------------------------- the cluster


def tiered_cluster(server: ServerProcess, name: str, bucket: str, s3: Any) -> list[str]:
    """A 2-node cluster persisting every 4th step to S3, with steps 2, 4 and 6 saved through node
    0's agent (step 4 committed on S3); its node ids in ring order."""
    sm = server.client()
    sm.create_cluster(
        ClusterName=name,
        InstanceGroups=[group("workers", 2, "ml.g5.2xlarge")],
        Orchestrator=EKS,
        TieredStorageConfig={"Mode": "Enable"},
    )
    with HyperPodClient(server.url) as client:
        client.wait_until_in_service(name, timeout=90)
        client.put_checkpoint_policy(name, S3BaseUri=f"s3://{bucket}/{name}", PersistEverySteps=4)
        client.wait_until_in_service(name, timeout=60)
        nodes = [n["InstanceId"] for n in client.list_nodes(name)]
    for step in (2, 4, 6):
        checkpoint(agent_of(server, name, nodes[0]), step)
    wait_for(lambda: markers(s3, bucket, f"{name}/{NS}/") == [4], timeout=60, what="step 4 on S3")
    return nodes


def agent_of(server: ServerProcess, name: str, node_id: str) -> str:
    node = httpx.get(f"{server.url}/clusters/{name}/nodes/{node_id}", timeout=10).json()["NodeDetails"]
    return str(node["AgentStatus"]["Endpoint"])


def heard_since(server: ServerProcess, name: str, nodes: list[str], since: float) -> bool:
    """Whether exactly ``nodes`` are there, Running, each heard from after ``since`` (epoch s)."""
    with HyperPodClient(server.url) as client:
        listed = client.list_nodes(name)
    return sorted(n["InstanceId"] for n in listed) == sorted(nodes) and all(
        n["InstanceStatus"]["Status"] == "Running"
        and float((n.get("AgentStatus") or {}).get("LastHeartbeatTime") or 0) > since
        for n in listed
    )


def descriptions(server: ServerProcess, name: str) -> list[str]:
    """The cluster's event descriptions, oldest first."""
    with HyperPodClient(server.url) as client:
        return [e["Description"] for e in reversed(client.events(name))]


def stays_down(seconds: float) -> None:
    """Keep the control plane down until ``seconds`` of silence have passed: longer than the
    heartbeat timeout, so that a node failed for it would show (a wait on wall time, not a race:
    the longer it takes, the surer the test)."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() > until, timeout=seconds + 30, what="the heartbeat timeout to pass")


def stop(server: ServerProcess, mode: str) -> int:
    """Stop ``serve`` the way ``mode`` names; its exit status."""
    assert server.process is not None
    if mode == "ctrl-c":  # the terminal's SIGINT goes to the whole foreground process group
        os.killpg(server.process.pid, signal.SIGINT)
    elif mode == "sigterm":
        server.process.send_signal(signal.SIGTERM)
    else:
        server.process.kill()
    return server.process.wait(timeout=90)


# ---------------------------------------------------------------------- the tests


@pytest.mark.parametrize(
    "settings_overrides", [{"provisioning": {"mode": "external", "heartbeat_timeout_s": 10}}]
)
def test_heartbeat_deadlines_count_from_the_control_planes_start(control_plane: ControlPlane) -> None:
    """The reconciler alone, on the manual clock: a node last heard an hour before a control plane
    starts is not failed at its start, but a heartbeat timeout after it."""
    sm = control_plane.client()
    sm.create_cluster(ClusterName="quiet", InstanceGroups=[group("workers", 1)], NodeRecovery="None")
    services = control_plane.services
    bootstrap = httpx.get(f"{control_plane.url}/clusters/quiet/agent-bootstrap").json()["BootstrapToken"]
    registered = services.agents.register(
        cluster_name="quiet", token=bootstrap, node_id=None, endpoint="http://127.0.0.1:9", pid=None
    )
    node, token = registered["node_id"], registered["node_token"]
    services.agents.heartbeat(
        cluster_name="quiet", node_id=node, token=token, applied_generation=1, endpoint=None, pid=None
    )
    wait_for(lambda: sm.describe_cluster(ClusterName="quiet")["ClusterStatus"] == "InService")
    services.reconciler.stop()  # the control plane goes down...

    control_plane.clock.advance(3600)  # ...for an hour; then another one starts on its database
    old = services.reconciler
    restarted = Reconciler(
        db=old.db, clock=old.clock, ids=old.ids, provisioner=old.provisioner, config=old.config
    )

    def status() -> str:
        summaries = sm.list_cluster_nodes(ClusterName="quiet")["ClusterNodeSummaries"]
        return str(summaries[0]["InstanceStatus"]["Status"])

    restarted.run_once()
    assert status() == "Running"
    control_plane.clock.advance(9)
    restarted.run_once()
    assert status() == "Running"
    control_plane.clock.advance(1)  # a heartbeat timeout since the start, and still silent
    restarted.run_once()
    assert status() == "Failure"
    assert (
        sm.describe_cluster_node(ClusterName="quiet", NodeId=node)["NodeDetails"]["InstanceStatus"]["Message"]
        == "Node failed: no heartbeat from its agent for 10 s."
    )


@pytest.mark.parametrize("mode", ["ctrl-c", "sigterm", "sigkill"])
def test_nodes_and_checkpoints_survive_a_restart(
    mode: str, database_url: str, data_dir: Path, moto_url: str, s3: Any, bucket: str
) -> None:
    env = agent_env(moto_url)
    first = ServerProcess(database_url, data_dir, env).start()
    try:
        nodes = tiered_cluster(first, "keep", bucket, s3)
        pids = {n: find_agent_pids(n) for n in nodes}
        assert all(len(p) == 1 for p in pids.values()), pids
        # Each agent has a session of its own: the terminal's Ctrl+C reaches the server only.
        assert first.process is not None
        assert all(os.getsid(p) != os.getsid(first.process.pid) for (p,) in pids.values())
        status = stop(first, mode)
    finally:
        first.kill()

    if mode == "sigkill":
        # The agents ran on without it, untouched: the same processes, one per node.
        assert status == -signal.SIGKILL
        assert {n: find_agent_pids(n) for n in nodes} == pids
        assert markers(s3, bucket, f"keep/{NS}/") == [4]
    else:
        # A graceful stop waits for its agents: none is left, and each drained first, so step 6
        # (the newest complete one, persisted by no schedule) is on S3 too.
        assert status == 0
        assert {n: find_agent_pids(n) for n in nodes} == {n: [] for n in nodes}
        assert markers(s3, bucket, f"keep/{NS}/") == [4, 6]
    assert all((shm_root_for(data_dir) / n).is_dir() for n in nodes)  # shared memory kept
    stays_down(HEARTBEAT_TIMEOUT_S + 1)

    second = ServerProcess(database_url, data_dir, env, port=first.port).start()
    try:
        deadline = time.time() + HEARTBEAT_TIMEOUT_S
        # Past the heartbeat deadline of the restart, every node is still the same one, Running,
        # heartbeating: none was failed, none replaced.
        wait_for(
            lambda: heard_since(second, "keep", nodes, deadline),
            timeout=60,
            what="the same nodes Running and heard from past the heartbeat deadline",
        )
        texts = descriptions(second, "keep")
        assert not [t for t in texts if " failed" in t or "replaced" in t], texts
        if mode == "sigkill":
            assert {n: find_agent_pids(n) for n in nodes} == pids  # adopted, not started twice
            assert "The control plane started: the agents of 2 nodes kept running and were adopted." in texts
        else:
            assert all(len(find_agent_pids(n)) == 1 for n in nodes)
            assert (
                "The control plane is stopping: it stopped the agents of 2 nodes, each after persisting "
                "its newest complete step to S3; their shared memory is kept and they start again with "
                "the control plane." in texts
            )
            assert (
                "The control plane started: the agents of 2 nodes were started again on their nodes "
                "(same node ids, same shared-memory directories)." in texts
            )

        # The trainer on node 0 resumes from its node's memory: the newest step, exactly.
        loaded = resume(agent_of(second, "keep", nodes[0]))
        assert (loaded.step, loaded.served_by) == (6, {0: "memory"})
        assert f"keep/{NS}/rank_0/step_4/checkpoint.pt" in keys(s3, bucket)

        assert stop(second, "sigterm") == 0
        assert {n: find_agent_pids(n) for n in nodes} == {n: [] for n in nodes}
    finally:
        second.kill()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_agents_of_a_killed_server_started_again_on_another_port_are_restarted_on_their_nodes(
    database_url: str, data_dir: Path, moto_url: str, s3: Any, bucket: str
) -> None:
    """Agents left by a killed control plane call the address they were started with: one on
    another port cannot adopt them, so it stops them (they drain) and starts them again."""
    env = agent_env(moto_url)
    first = ServerProcess(database_url, data_dir, env).start()
    try:
        nodes = tiered_cluster(first, "moved", bucket, s3)
        pids = {n: find_agent_pids(n) for n in nodes}
        stop(first, "sigkill")
    finally:
        first.kill()
    stays_down(HEARTBEAT_TIMEOUT_S + 1)

    second = ServerProcess(database_url, data_dir, env).start()  # another port
    try:
        up = time.time()
        wait_for(lambda: heard_since(second, "moved", nodes, up), timeout=60, what="the same nodes Running")
        now = {n: find_agent_pids(n) for n in nodes}
        assert all(len(p) == 1 and p != pids[n] for n, p in now.items()), (pids, now)
        assert markers(s3, bucket, f"moved/{NS}/") == [4, 6]  # drained when they were stopped
        loaded = resume(agent_of(second, "moved", nodes[0]))
        assert (loaded.step, loaded.served_by) == (6, {0: "memory"})
        texts = descriptions(second, "moved")
        assert not [t for t in texts if " failed" in t or "replaced" in t], texts
        started = "The control plane started: the agents of 2 nodes were started again on their nodes"
        assert any(t.startswith(started) for t in texts), texts
    finally:
        second.stop()


def test_after_a_reboot_nodes_come_back_empty_and_the_trainer_resumes_from_s3(
    database_url: str, data_dir: Path, moto_url: str, s3: Any, bucket: str
) -> None:
    env = agent_env(moto_url)
    first = ServerProcess(database_url, data_dir, env).start()
    try:
        nodes = tiered_cluster(first, "boot", bucket, s3)
        # The machine goes down: every process at once, and shared memory with it.
        stop(first, "sigkill")
        for node in nodes:
            for pid in find_agent_pids(node):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(find_agent_pids(n) for n in nodes), timeout=30, what="the agents gone")
        shutil.rmtree(shm_root_for(data_dir))
    finally:
        first.kill()
    stays_down(HEARTBEAT_TIMEOUT_S + 1)

    second = ServerProcess(database_url, data_dir, env, port=first.port).start()
    try:
        up = time.time()
        wait_for(lambda: heard_since(second, "boot", nodes, up), timeout=60, what="the same nodes Running")
        loaded = resume(agent_of(second, "boot", nodes[0]))
        # Step 6 was only in memory; step 4 was committed on S3.
        assert (loaded.step, loaded.served_by) == (4, {0: "s3"})
        texts = descriptions(second, "boot")
        assert not [t for t in texts if " failed" in t or "replaced" in t], texts
    finally:
        second.stop()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_second_ctrl_c_kills_the_agents_still_draining(database_url: str, data_dir: Path) -> None:
    """The first Ctrl+C waits for the agents to drain (up to the kill grace, 60 s by default);
    a second one does not wait: what still runs is killed, and serve exits."""
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__AGENT_COMMAND": json.dumps(LINGERING_AGENT),
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_S3__EMBEDDED": "false",
    }
    server = ServerProcess(database_url, data_dir, env).start()
    try:
        sm = server.client()
        sm.create_cluster(ClusterName="slow", InstanceGroups=[group("workers", 1, "ml.g5.2xlarge")])
        with HyperPodClient(server.url) as client:
            client.wait_until_in_service("slow", timeout=90)
            (node,) = [n["InstanceId"] for n in client.list_nodes("slow")]
        assert len(find_agent_pids(node)) == 2  # the lingering wrapper and the agent it runs
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGINT)
        # The agent got its SIGTERM and exited; its wrapper lingers, as a long drain would.
        wait_for(lambda: len(find_agent_pids(node)) == 1, timeout=30, what="the agent told to stop")
        assert server.process.poll() is None  # still waiting for it
        os.killpg(server.process.pid, signal.SIGINT)
        assert server.process.wait(timeout=30) == 0
        assert find_agent_pids(node) == []
        assert not (data_dir / "agents" / node / "release").exists()  # killed, never released
    finally:
        server.kill()


def test_two_servers_on_one_data_dir_or_sqlite_file_refuse(database_url: str, tmp_path: Path) -> None:
    env = {"HPSIM_PROVISIONING__MODE": "simulated", "HPSIM_S3__EMBEDDED": "false"}
    first = ServerProcess(database_url, tmp_path, env).start()
    try:
        assert first.process is not None

        def serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
            argv = [sys.executable, "-m", "hyperpod_sim", "serve", "--port", "0"]
            argv += ["--database-url", database_url, "--data-dir", str(data_dir)]
            environ = {**os.environ, **env}
            return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=60, check=False)

        same_dir = serve(tmp_path)
        assert same_dir.returncode == 1
        lock = (tmp_path / "serve.lock").resolve()
        assert same_dir.stderr == (
            f"hyperpod-sim serve: another control plane (pid {first.process.pid}) is serving data dir "
            f"{lock.parent} (lock {lock}); stop it first, or give this one its own --data-dir (and, on "
            "SQLite, --database-url)\n"
        )
        if database_url.startswith("sqlite"):
            other_dir = serve(tmp_path / "other")
            assert other_dir.returncode == 1
            database = Path(database_url.removeprefix("sqlite:///")).resolve()
            assert f"(pid {first.process.pid}) is serving SQLite database {database}" in other_dir.stderr
        # The first one was not disturbed.
        assert first.client().list_clusters()["ClusterSummaries"] == []
    finally:
        first.stop()
    # Once it has stopped, the data dir is free again (the lock goes with the process).
    ServerProcess(database_url, tmp_path, env).start().stop()


@pytest.mark.parametrize("secret_committed", [True, False], ids=["secret-committed", "secret-lost"])
def test_creating_cluster_finishes_after_restart(
    database_url: str, tmp_path: Path, secret_committed: bool
) -> None:
    """The nodes' agents start only when the test lets them (tests/gated_agent.py), after the
    restart: the cluster is Creating across it whatever the machine's speed. ``secret-lost``: the
    server was killed after starting the agents but before it committed their launch secrets (a
    clean-clone CI run hit that window), so they cannot register; the next server starts them
    again with secrets of its own."""
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__AGENT_COMMAND": json.dumps(GATED_AGENT),
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_RECONCILER__INTERVAL_S": "0.2",
        "HPSIM_S3__EMBEDDED": "false",
    }
    data_dir = tmp_path
    first = ServerProcess(database_url, data_dir, env).start()
    try:
        sm = first.client()
        arn = sm.create_cluster(
            ClusterName="survivor",
            InstanceGroups=[group("a", 2)],
            Tags=[{"Key": "team", "Value": "research"}],
        )["ClusterArn"]
        assert sm.describe_cluster(ClusterName="survivor")["ClusterStatus"] == "Creating"

        def launched() -> list[str] | None:
            summaries = sm.list_cluster_nodes(ClusterName="survivor")["ClusterNodeSummaries"]
            found = [n["InstanceId"] for n in summaries]
            return found if len(found) == 2 and all(find_agent_pids(n) for n in found) else None

        nodes = wait_for(launched, timeout=30, what="both nodes launched, their agents waiting")
    finally:
        first.kill()
    if not secret_committed:
        engine = create_engine(database_url)
        with engine.begin() as connection:
            connection.execute(text("UPDATE nodes SET launch_secret_hash = NULL"))
        engine.dispose()

    second = ServerProcess(database_url, data_dir, env, port=first.port).start()
    try:
        sm = second.client()
        described = sm.describe_cluster(ClusterName="survivor")
        assert described["ClusterArn"] == arn
        assert described["ClusterStatus"] == "Creating"
        for node in nodes:
            (data_dir / "agents" / node / "start").touch()

        def in_service() -> bool:
            return sm.describe_cluster(ClusterName="survivor")["ClusterStatus"] == "InService"

        wait_for(in_service, timeout=60, what="the cluster to finish creating after the restart")
        assert described["InstanceGroups"][0]["TargetCount"] == 2
        summaries = sm.list_cluster_nodes(ClusterName="survivor")["ClusterNodeSummaries"]
        assert sorted(n["InstanceId"] for n in summaries) == sorted(nodes)
        assert sm.list_tags(ResourceArn=arn)["Tags"] == [{"Key": "team", "Value": "research"}]
    finally:
        second.stop()
        kill_processes_under(tmp_path)


def test_a_move_goes_on_after_a_restart_while_its_node_detaches(database_url: str, data_dir: Path) -> None:
    """MoveClusterNodes: the moved node's agent takes its time to drain (tests/lingering_agent.py),
    and the control plane is killed meanwhile. The next one finds the node DetachInProgress, adopts
    the draining agent, waits for it, and hands the node off: it runs in the target group, same id."""
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__AGENT_COMMAND": json.dumps(LINGERING_AGENT),
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_RECONCILER__INTERVAL_S": "0.2",
        "HPSIM_S3__EMBEDDED": "false",
    }
    first = ServerProcess(database_url, data_dir, env).start()
    try:
        sm = first.client()
        for name, count in (("src", 2), ("dst", 1)):
            sm.create_cluster(
                ClusterName=name,
                InstanceGroups=[group("workers", count, "ml.g5.2xlarge")],
                Orchestrator=EKS,
                NodeProvisioningMode="Continuous",
            )
        with HyperPodClient(first.url) as client:
            for name in ("src", "dst"):
                client.wait_until_in_service(name, timeout=90)
            moved, stays = sorted(n["InstanceId"] for n in client.list_nodes("src"))
        arns = {name: sm.describe_cluster(ClusterName=name)["ClusterArn"] for name in ("src", "dst")}
        sm.move_cluster_nodes(
            SourceClusterArn=arns["src"],
            SourceInstanceGroupName="workers",
            TargetClusterArn=arns["dst"],
            TargetInstanceGroupName="workers",
            NodeIds=[moved],
        )
        # Its agent got its SIGTERM and exited; the wrapper lingers, as a long drain to S3 would.
        wait_for(
            lambda: len(find_agent_pids(moved)) == 1, timeout=30, what="the moved node's agent told to stop"
        )
    finally:
        first.kill()

    # The next control plane starts plain agents (the lingering one it adopts is the last one's).
    plain = {key: value for key, value in env.items() if key != "HPSIM_PROVISIONING__AGENT_COMMAND"}
    second = ServerProcess(database_url, data_dir, plain, port=first.port).start()
    try:
        sm = second.client()
        status = sm.describe_cluster_node(ClusterName="src", NodeId=moved)["NodeDetails"]["InstanceStatus"]
        assert status["Status"] == "DetachInProgress"
        (data_dir / "agents" / moved / "release").touch()  # the drain is over

        def running_in_target() -> bool:
            listed = sm.list_cluster_nodes(ClusterName="dst")["ClusterNodeSummaries"]
            return any(
                n["InstanceId"] == moved and n["InstanceStatus"]["Status"] == "Running" for n in listed
            )

        wait_for(running_in_target, timeout=90, what="the moved node Running in dst")
        src_nodes = sm.list_cluster_nodes(ClusterName="src")["ClusterNodeSummaries"]
        assert [n["InstanceId"] for n in src_nodes] == [stays]
        groups = {name: sm.describe_cluster(ClusterName=name)["InstanceGroups"][0] for name in ("src", "dst")}
        assert {name: (g["CurrentCount"], g["TargetCount"]) for name, g in groups.items()} == {
            "src": (1, 1),
            "dst": (2, 2),
        }
        with HyperPodClient(second.url) as client:
            moved_agent = client.describe_node("dst", moved)["AgentStatus"]["Endpoint"]
        assert httpx.get(f"{moved_agent}/v1/policy", timeout=10).json()["cluster_name"] == "dst"
    finally:
        second.stop()
