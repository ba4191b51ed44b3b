"""The agent launcher (hyperpod_sim/agents/launcher/, hyperpod_sim/infra/launcher.py): the local
provisioner's default agents are forked by it, each in a session of its own; killing one touches
no other node; DeleteCluster leaves none; a restart of serve adopts them. Its socket refuses
another user, malformed JSON and requests of the wrong shape, and starts nothing for them. It marks
its memory and its agents' mergeable by the kernel's same-page merging unless told not to."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyperpod_sim.agents.launcher.server import MAX_REQUEST
from hyperpod_sim.contracts.processes import start_time
from hyperpod_sim.infra.launcher import AgentLauncher, LauncherError, ask
from hyperpod_sim.infra.local import agent_environment
from hyperpod_sim.infra.processes import Pidfile, command_line, find_agent_pids, parent_pid, pids_mentioning
from hyperpod_sim.sdk.client import HyperPodClient
from hyperpod_sim.settings import default_agent_command
from tests.conftest import ControlPlane, ServerProcess, group, kill_processes_under, wait_for

SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def agent_pids(data_dir: Path, node_ids: list[str]) -> dict[str, int]:
    """Each node's agent pid, from the pidfile the provisioner wrote (running agents only)."""
    found = {}
    for node_id in node_ids:
        pidfile = Pidfile.read(data_dir / "agents" / node_id)
        if pidfile is not None and pidfile.alive():
            found[node_id] = pidfile.pid
    return found


def launcher_pid(data_dir: Path) -> int:
    (pid,) = pids_mentioning(data_dir / "launcher", "agent-launcher")
    return pid


def running(client: HyperPodClient, name: str) -> dict[str, float]:
    """Running nodes of ``name`` -> their last heartbeat."""
    return {
        n["InstanceId"]: float((n.get("AgentStatus") or {}).get("LastHeartbeatTime") or 0)
        for n in client.list_nodes(name)
        if n["InstanceStatus"]["Status"] == "Running"
    }


@SQLITE
def test_agents_are_forked_and_a_kill_touches_no_other_node(agent_plane: ControlPlane, client: Any) -> None:
    data_dir = Path(agent_plane.services.settings.data_dir).resolve()
    sm = agent_plane.client()
    sm.create_cluster(ClusterName="fleet", InstanceGroups=[group("workers", 8, "ml.c5.large")])
    client.wait_until_in_service("fleet", timeout=120)
    nodes = sorted(n["InstanceId"] for n in client.list_nodes("fleet"))
    pids = agent_pids(data_dir, nodes)
    assert sorted(pids) == nodes
    launcher = launcher_pid(data_dir)
    for node_id, pid in pids.items():
        assert parent_pid(pid) == launcher, node_id  # forked by the launcher, not exec'ed by serve
        assert os.getsid(pid) == pid  # a session and process group of its own
        assert os.getpgid(pid) == pid
        argv = command_line(pid) or []
        assert argv[:4] == default_agent_command()
        assert argv[argv.index("--node-id") + 1] == node_id
        assert find_agent_pids(node_id) == [pid]  # what observers find by command line
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert any(item.startswith(b"HPSIM_AGENT_TOKEN=") for item in environ)

    victim, others = nodes[0], nodes[1:]
    heard = running(client, "fleet")
    os.kill(pids[victim], signal.SIGKILL)

    def restarted() -> int | None:
        now = agent_pids(data_dir, [victim]).get(victim)
        up = running(client, "fleet")
        return now if now not in (None, pids[victim]) and victim in up else None

    new_pid = wait_for(restarted, timeout=60, what="serve to restart the killed agent")
    assert parent_pid(new_pid) == launcher
    # The other nodes kept their agents, and they kept heartbeating, Running, all along.
    assert agent_pids(data_dir, others) == {n: pids[n] for n in others}
    wait_for(
        lambda: all(running(client, "fleet").get(n, 0) > heard[n] for n in others),
        timeout=30,
        what="a heartbeat of every other node after the kill",
    )
    assert agent_pids(data_dir, others) == {n: pids[n] for n in others}
    assert all(start_time(pids[n]) is not None for n in others)

    sm.delete_cluster(ClusterName="fleet")
    everyone = [new_pid, *pids.values()]
    wait_for(
        lambda: (
            not pids_mentioning(data_dir / "agents", "agent")
            and all(start_time(pid) is None for pid in everyone)
        ),
        timeout=90,
        what="no agent process left after DeleteCluster",
    )


@SQLITE
def test_a_dead_launcher_is_started_again_and_its_agents_live_on(
    agent_plane: ControlPlane, client: Any
) -> None:
    data_dir = Path(agent_plane.services.settings.data_dir).resolve()
    agent_plane.client().create_cluster(
        ClusterName="two", InstanceGroups=[group("workers", 2, "ml.c5.large")]
    )
    client.wait_until_in_service("two", timeout=90)
    nodes = sorted(n["InstanceId"] for n in client.list_nodes("two"))
    pids = agent_pids(data_dir, nodes)
    first = launcher_pid(data_dir)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: parent_pid(pids[nodes[0]]) != first, timeout=30, what="the agents to lose their parent")
    os.kill(pids[nodes[0]], signal.SIGKILL)  # its restart needs a launcher: a new one

    def restarted() -> int | None:
        now = agent_pids(data_dir, [nodes[0]]).get(nodes[0])
        return now if now not in (None, pids[nodes[0]]) and nodes[0] in running(client, "two") else None

    new_pid = wait_for(restarted, timeout=60, what="the killed agent started by a new launcher")
    second = launcher_pid(data_dir)
    assert second != first
    assert parent_pid(new_pid) == second
    assert agent_pids(data_dir, [nodes[1]]) == {nodes[1]: pids[nodes[1]]}  # lived on without its launcher


# ---------------------------------------------------------------------- the launcher's socket


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[AgentLauncher]:
    made = AgentLauncher(directory=tmp_path / "launcher", env=agent_environment(os.environ))
    yield made
    made.stop()
    kill_processes_under(tmp_path)


def children_of(pid: int) -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and parent_pid(int(e.name)) == pid]


def started(launcher: AgentLauncher, tmp_path: Path) -> int:
    """Start the launcher with one request it refuses (an argv of another command): its pid."""
    with pytest.raises(LauncherError, match="must start with the agent command"):
        launcher.launch(["/bin/true"], env={}, log_path=tmp_path / "x.log")
    assert launcher.pid is not None
    return launcher.pid


BAD_REQUESTS = [
    pytest.param(b"{not json\n", "not a JSON document", id="malformed-json"),
    pytest.param(b'["argv"]\n', "exactly", id="not-an-object"),
    pytest.param(b'{"argv": [], "env": {}, "log": "/tmp/x"}\n', "argv", id="empty-argv"),
    pytest.param(b'{"argv": "python", "env": {}, "log": "/tmp/x"}\n', "argv", id="argv-a-string"),
    pytest.param(b'{"argv": [1], "env": {}, "log": "/tmp/x"}\n', "argv", id="argv-of-numbers"),
    pytest.param(b'{"argv": ["a"], "env": {"A": 1}, "log": "/tmp/x"}\n', "env", id="env-value-not-str"),
    pytest.param(b'{"argv": ["a"], "env": {"A=B": "c"}, "log": "/tmp/x"}\n', "env", id="env-name-with-="),
    pytest.param(b'{"argv": ["a"], "env": {}, "log": "relative.log"}\n', "log", id="log-relative"),
    pytest.param(
        b'{"argv": ["a"], "env": {}, "log": "/tmp/x", "code": "import os"}\n', "exactly", id="extra-member"
    ),
    pytest.param(
        b'{"argv": ["/bin/sh", "-c", "touch /tmp/pwned"], "env": {}, "log": "/tmp/x"}\n',
        "must start with the agent command",
        id="another-command",
    ),
    pytest.param(b"[" * (MAX_REQUEST + 1), "larger than", id="too-large"),
]


@pytest.mark.parametrize(("request_bytes", "error"), BAD_REQUESTS)
def test_the_launcher_refuses_a_bad_request_and_starts_nothing(
    launcher: AgentLauncher, tmp_path: Path, request_bytes: bytes, error: str
) -> None:
    pid = started(launcher, tmp_path)
    before = children_of(pid)
    answer = ask(launcher.socket_path, request_bytes)
    assert set(answer) == {"error"}, answer
    assert error in str(answer["error"]), answer
    assert children_of(pid) == before == []
    assert launcher.pid == pid  # still serving
    with pytest.raises(LauncherError, match="must start with the agent command"):
        launcher.launch([sys.executable, "-c", "pass"], env={}, log_path=tmp_path / "x.log")


def test_a_launcher_under_a_deep_data_dir_answers(tmp_path: Path) -> None:
    """A Unix socket's path holds 108 bytes at most: a data dir deeper than that (pytest's own
    under xdist came within a byte of it) must not keep agents from starting."""
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 5)
    assert len(str(deep / "launcher" / "launcher.sock")) > 108
    made = AgentLauncher(directory=deep / "launcher", env=agent_environment(os.environ))
    try:
        assert started(made, tmp_path) > 0  # it listened, and answered a request
    finally:
        made.stop()
        kill_processes_under(tmp_path)


def test_the_launcher_socket_is_in_a_directory_of_its_user_only(
    launcher: AgentLauncher, tmp_path: Path
) -> None:
    started(launcher, tmp_path)
    info = launcher.directory.stat()
    assert (info.st_mode & 0o777, info.st_uid) == (0o700, os.getuid())


def test_the_launcher_will_not_serve_from_an_open_directory(tmp_path: Path) -> None:
    directory = tmp_path / "launcher"
    directory.mkdir()
    directory.chmod(0o755)
    argv = [sys.executable, "-m", "hyperpod_sim", "agent-launcher"]
    argv += ["--socket", str(directory / "s.sock"), "--parent", str(os.getpid())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "must be a directory of uid" in done.stderr
    assert "mode 0700" in done.stderr
    assert not (directory / "s.sock").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a peer of another uid is a child that setuid()s")
def test_the_launcher_refuses_a_peer_of_another_uid(tmp_path: Path) -> None:
    # Under /tmp, not pytest's tmp_path (its parents are 0700): the opened directory below is then
    # the only thing between the other user and the socket.
    outer = Path(tempfile.mkdtemp(prefix="hpsim-launcher-"))
    outer.chmod(0o711)
    launcher = AgentLauncher(directory=outer / "launcher", env=agent_environment(os.environ))
    try:
        refuses_another_uid(launcher, tmp_path)
    finally:
        launcher.stop()
        shutil.rmtree(outer, ignore_errors=True)


def refuses_another_uid(launcher: AgentLauncher, tmp_path: Path) -> None:
    pid = started(launcher, tmp_path)
    request = json.dumps(
        {"argv": [*default_agent_command(), "--help"], "env": {}, "log": str(tmp_path / "nobody.log")}
    ).encode()

    def as_nobody() -> str:
        """What user 65534 gets from the launcher's socket, from a child that drops to it."""
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                os.close(read)
                os.setgid(65534)
                os.setuid(65534)
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sock.settimeout(10)
                        sock.connect(str(launcher.socket_path))
                        with contextlib.suppress(BrokenPipeError):  # it may answer before reading
                            sock.sendall(request + b"\n")
                        result = sock.recv(4096).decode(errors="replace")
                except OSError as exc:
                    result = f"OSError {exc.errno}"
                os.write(write, result.encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            got = pipe.read().decode()
        os.waitpid(child, 0)
        return got

    # Its directory (0700) keeps other users from the socket at all...
    assert as_nobody() == "OSError 13"
    # ...and were it open, the launcher checks the peer's uid.
    launcher.directory.chmod(0o711)
    launcher.socket_path.chmod(0o777)
    answer = json.loads(as_nobody())
    assert answer == {"error": "refused: the launcher serves its own user only"}
    assert children_of(pid) == []
    assert not (tmp_path / "nobody.log").exists()


# ---------------------------------------------------------------------- a restart of serve


@SQLITE
def test_a_restarted_serve_adopts_the_forked_agents(database_url: str, tmp_path: Path) -> None:
    env = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "0.2",
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "30",
        "HPSIM_RECONCILER__INTERVAL_S": "0.2",
        "HPSIM_S3__EMBEDDED": "off",
        "HPSIM_AGENT_REGISTER_BACKOFF_MAX_S": "0.5",
    }
    data_dir = tmp_path.resolve()
    server = ServerProcess(database_url, tmp_path, env).start()
    try:
        sm = server.client()
        sm.create_cluster(ClusterName="kept", InstanceGroups=[group("workers", 2, "ml.c5.large")])
        with HyperPodClient(server.url) as client:
            client.wait_until_in_service("kept", timeout=90)
            nodes = sorted(n["InstanceId"] for n in client.list_nodes("kept"))
        pids = agent_pids(data_dir, nodes)
        first_launcher = launcher_pid(data_dir)
        assert {parent_pid(pid) for pid in pids.values()} == {first_launcher}

        server.kill()  # a crash: its launcher follows it, its agents live on
        wait_for(lambda: start_time(first_launcher) is None, timeout=30, what="the launcher to exit")
        assert all(start_time(pid) is not None for pid in pids.values())

        server = ServerProcess(database_url, tmp_path, env, port=server.port).start()
        with HyperPodClient(server.url) as client:

            def heard_again() -> bool:
                nodes_now = client.list_nodes("kept")
                return len(nodes_now) == 2 and all(
                    n["InstanceStatus"]["Status"] == "Running" for n in nodes_now
                )

            wait_for(heard_again, timeout=60, what="both nodes Running after the restart")
            assert client.describe_cluster("kept")["ClusterStatus"] == "InService"
        assert agent_pids(data_dir, nodes) == pids  # adopted, not started again
        assert {n: find_agent_pids(n) for n in nodes} == {n: [pids[n]] for n in nodes}
    finally:
        server.stop()
        kill_processes_under(tmp_path)


def test_a_forked_agent_with_an_invalid_setting_says_so_in_its_own_log(
    launcher: AgentLauncher, tmp_path: Path
) -> None:
    # The launcher builds an agent's settings before it forks it, from the environment the request
    # gives (the launcher's own has no HPSIM_AGENT_PORT): a bad one is the agent's to report, in
    # its own log, and no agent runs.
    log = tmp_path / "agent.log"
    env = {**agent_environment(os.environ), "HPSIM_AGENT_PORT": "70000", "HPSIM_AGENT_TOKEN": "t" * 32}
    argv = [*default_agent_command(), "--control-plane", "http://127.0.0.1:9", "--cluster", "c"]
    pid = launcher.launch(argv, env=env, log_path=log)
    wait_for(lambda: "invalid settings" in (log.read_text() if log.exists() else ""), timeout=30)
    assert "--port (HPSIM_AGENT_PORT)" in log.read_text()
    wait_for(lambda: pid not in children_of(launcher.pid or 0), timeout=30, what="the agent to exit")


# ---------------------------------------------------------------------- same-page merging (KSM)


def merge_any(pid: int) -> bool | None:
    """Whether the kernel may merge any of the process's anonymous pages (``ksm_merge_any`` of
    /proc/<pid>/ksm_stat); None where it does not say."""
    try:
        text = Path(f"/proc/{pid}/ksm_stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("ksm_merge_any:"):
            return line.split(":", 1)[1].strip() == "yes"
    return None


@pytest.mark.skipif(
    merge_any(os.getpid()) is None, reason="this kernel does not report ksm_merge_any (/proc/<pid>/ksm_stat)"
)
@pytest.mark.parametrize("merge", [True, False], ids=["merge", "no-merge"])
def test_an_agent_forked_by_the_launcher_has_mergeable_pages_unless_turned_off(
    tmp_path: Path, merge: bool
) -> None:
    # What the agents only touched is copied into each of them alike: the launcher marks its
    # memory mergeable (prctl PR_SET_MEMORY_MERGE) and every agent it forks inherits the mark, so
    # the machine's ksmd (where it runs) keeps those pages once. merge_agent_pages=false: neither.
    launcher = AgentLauncher(
        directory=tmp_path / "launcher", env=agent_environment(os.environ), merge_pages=merge
    )
    try:
        env = {**agent_environment(os.environ), "HPSIM_AGENT_TOKEN": "t" * 32}
        argv = [
            *default_agent_command(),
            *("--control-plane", "http://127.0.0.1:9", "--cluster", "c", "--node-id", "i-0123456789abcdef0"),
            *("--data-dir", str(tmp_path / "agent"), "--shm-dir", str(tmp_path / "shm")),
            *("--host", "127.0.0.1", "--port", "0"),
        ]
        log = tmp_path / "agent.log"
        pid = launcher.launch(argv, env=env, log_path=log)
        wait_for(lambda: "hyperpod-sim agent on" in (log.read_text() if log.exists() else ""), timeout=30)
        assert merge_any(pid) is merge
        assert launcher.pid is not None
        assert merge_any(launcher.pid) is merge
        said = (tmp_path / "launcher" / "launcher.log").read_text()
        assert ("pages are mergeable" in said) is merge, said
        assert merge_any(os.getpid()) is False  # the mark stays with the launcher and its agents
    finally:
        launcher.stop()
        kill_processes_under(tmp_path)


def unmergeable_private_mappings(pid: int) -> list[str]:
    """The private writable mappings of process ``pid`` that the kernel may not merge (no ``mg``
    in their VmFlags): in a process with every page mergeable, those it was told to keep apart."""
    found, header = [], ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and ":" not in fields[0]:
            header = line
        elif line.startswith("VmFlags:") and header.split()[1][1::2] == "wp" and "mg" not in fields[1:]:
            found.append(header)
    return found


@SQLITE
@pytest.mark.skipif(
    merge_any(os.getpid()) is None, reason="this kernel does not report ksm_merge_any (/proc/<pid>/ksm_stat)"
)
def test_a_forked_agent_keeps_the_pages_a_push_writes_out_of_merging(
    agent_plane: ControlPlane, client: Any
) -> None:
    # Once its first policy is in force, each agent finds the pages a push writes (a push to
    # itself, agents/launcher/hotpages.py) and has the kernel keep them unmerged: the first
    # rollout after ksmd merged the cluster does not copy them back.
    data_dir = Path(agent_plane.services.settings.data_dir).resolve()
    sm = agent_plane.client()
    sm.create_cluster(ClusterName="hot", InstanceGroups=[group("workers", 2, "ml.c5.large")])
    client.wait_until_in_service("hot", timeout=120)
    nodes = sorted(n["InstanceId"] for n in client.list_nodes("hot"))
    pids = agent_pids(data_dir, nodes)
    assert sorted(pids) == nodes
    for node_id, pid in pids.items():
        assert merge_any(pid) is True, node_id
        wait_for(
            lambda pid=pid: unmergeable_private_mappings(pid), timeout=30, what=f"{node_id}: pages kept apart"
        )
        assert find_agent_pids(node_id) == [pid]  # its twin is gone, and was never taken for it
    sm.delete_cluster(ClusterName="hot")
