"""Finding 3 of issue 23: the host is shared. Whoever made the shared-memory root first owned the
checkpoints.

As another local user: ``mkdir /dev/shm/hpsim; chmod 777`` (the default root; ``/dev/shm`` is
empty after a reboot). ``serve`` used it without looking at its owner or mode; that user renamed
a node's directory away, planted ``job/0/999.shard`` with a matching ``.meta`` sidecar, and after
the next agent restart ``latest`` was ``[999]`` and the forged bytes were served.

Now ``serve`` and the agents refuse a tree another user could change (and say which directory and
why), sidecars are sealed with a key only the agent holds, and a restarted agent adopts only the
shards it sealed, whose bytes match. The attacks are made as the issue made them: as uid 65534
(``nobody``) where they need another user, with real ``serve`` and agent processes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.infra.processes import find_agent_pids
from tests.conftest import ControlPlane, free_port, launch_secret, shm_root_for, wait_for
from tests.tier import cluster, create_namespace, get, latest, put, url

pytestmark = pytest.mark.patient_heartbeats
on_sqlite = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid (65534) needs root")

# What the other user runs (a shell, as uid 65534): write a shard (from stdin) and a sidecar that
# describes it as the store's sidecars did before they were sealed (inode, size, checksum).
PLANT = """set -e
mkdir -p "$1"
cat > "$1/999.shard"
printf '{"version": 1, "current": {"size": %s, "checksum": "%s", ' "$2" "$3" > "$1/999.meta"
printf '"replica_of": null, "committed_at": 5e9, ' >> "$1/999.meta"
printf '"inode": %s}, ' "$(stat -c %i "$1/999.shard")" >> "$1/999.meta"
printf '"previous": null}' >> "$1/999.meta"
"""
FORGED = b"forged weights " * 1000


def as_nobody(script: str, *args: str, stdin: bytes = b"") -> None:
    """Run a shell script as uid 65534, in no group of ours."""
    subprocess.run(
        ["/bin/sh", "-c", script, "sh", *args],
        input=stdin,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        check=True,
    )


def plant(rank_dir: Path, *, as_other_user: bool) -> None:
    args = (str(rank_dir), str(len(FORGED)), checksum_of(FORGED))
    if as_other_user:
        as_nobody(PLANT, *args, stdin=FORGED)
    else:
        subprocess.run(["/bin/sh", "-c", PLANT, "sh", *args], input=FORGED, check=True)


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def squat_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"hpsim-squat-{uuid.uuid4().hex[:12]}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@needs_root
@pytest.mark.parametrize("squatter", ["another user", "world-writable"])
def test_serve_refuses_a_squatted_shared_memory_root(squat_root: Path, tmp_path: Path, squatter: str) -> None:
    if squatter == "another user":  # made by uid 65534, open to all, a node's files planted in it
        as_nobody('mkdir "$1" && chmod 777 "$1"', str(squat_root))
        plant(squat_root / "i-planted" / "job" / "0", as_other_user=True)
        problem = (
            f"{squat_root} belongs to uid {NOBODY}, not to this process's user (uid 0): another local "
            "user made it and could rename or replace what is in it"
        )
    else:  # ours, but any user may rename what is in it
        squat_root.mkdir()
        os.chmod(squat_root, 0o777)
        problem = (
            f"{squat_root} has mode 0777: other users may write into it (it must be writable by its "
            "owner only, 0700)"
        )
    env = {
        **os.environ,
        "HPSIM_SIMULATION__SHM_ROOT": str(squat_root),
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_S3__EMBEDDED": "off",
    }
    argv = [sys.executable, "-m", "hyperpod_sim", "serve", "--port", str(free_port())]
    argv += ["--data-dir", str(tmp_path / "data")]
    # Before, it served (and this ran into the timeout).
    done = subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr.decode(errors="replace")
    assert done.stderr.decode() == (
        f"hyperpod-sim serve: refusing the shared-memory root: {problem}. Remove it (the checkpoints in "
        "it cannot be trusted), or set HPSIM_SIMULATION__SHM_ROOT to a directory of this user's only. "
        "See docs/security.md.\n"
    )
    assert not (tmp_path / "data").exists()  # nothing was started


def restart_agent(plane: ControlPlane, node_id: str, log: Path) -> subprocess.Popen[bytes]:
    """Kill the node's agent and start it again as the provisioner does (same node, same shared
    memory and data dir, a new launch secret)."""
    (pid,) = find_agent_pids(node_id)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    environ = dict(
        item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item
    )
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not find_agent_pids(node_id), timeout=30, what="the agent to die")
    environ[b"HPSIM_AGENT_TOKEN"] = launch_secret(plane, node_id).encode()
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=environ, stdout=out, stderr=subprocess.STDOUT)


def endpoint_in(log: Path) -> str | None:
    found = re.search(r"hyperpod-sim agent on (http://\S+)", log.read_text(errors="replace"))
    return found.group(1) if found else None


def fast_locate(agent: str, step: int) -> int:
    return httpx.get(f"{agent}/v1/fast/shards/job/0/{step}").status_code


# The killed agent is started again by the test, not by the control plane.
@on_sqlite
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_a_planted_shard_is_not_adopted_after_a_restart_nor_served(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    (node,) = cluster(sm, agent_plane, "plant", 1)
    agent, node_id = url(node), node["InstanceId"]
    assert create_namespace(agent, "job", 1).status_code == 201
    data = os.urandom(100_000)
    assert put(agent, "job", 0, 1, data).status_code == 200
    rank_dir = shm_root_for(tmp_path) / node_id / "job" / "0"
    plant(rank_dir, as_other_user=False)  # files the agent did not write, with a matching sidecar

    log = tmp_path / "restarted.log"
    restarted = restart_agent(agent_plane, node_id, log)
    try:
        again = wait_for(lambda: endpoint_in(log), timeout=60, what="the restarted agent's endpoint")
        wait_for(lambda: httpx.get(f"{again}/health").json()["registered"], timeout=60, what="registration")
        # Before: latest was [999, 1] and the forged bytes were served as this node's.
        assert latest(again, "job") == [1]
        assert get(again, "job", 0, 999).status_code == 404
        assert fast_locate(again, 999) == 404
        assert get(again, "job", 0, 1).content == data
        assert sorted(p.name for p in rank_dir.iterdir() if not p.name.endswith(".spare")) == [
            "1.meta",
            "1.shard",
        ]
        assert f"not adopting {rank_dir / '999.shard'}: no sidecar that this store sealed" in log.read_text()
    finally:
        restarted.kill()
        restarted.wait(timeout=30)


@needs_root
@on_sqlite
@pytest.mark.parametrize("agent_settings", [{"provisioning": {"restart_agents": False}}], indirect=True)
def test_a_node_directory_renamed_and_replaced_is_neither_written_nor_adopted(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    (node,) = cluster(sm, agent_plane, "moved", 1)
    agent, node_id = url(node), node["InstanceId"]
    assert create_namespace(agent, "job", 1).status_code == 201
    assert put(agent, "job", 0, 1, os.urandom(50_000)).status_code == 200
    # The node's directory renamed away and another user's in its place, open to all, with a
    # shard of that user's (what the attacker did under the squatted root; that user
    # cannot reach into the root serve makes now, so the test plants and hands the files over).
    node_dir = shm_root_for(tmp_path) / node_id
    node_dir.rename(node_dir.with_name(f"{node_id}.moved"))
    plant(node_dir / "job" / "0", as_other_user=False)
    for path in (node_dir, *node_dir.rglob("*")):
        os.chown(path, NOBODY, NOBODY)
        os.chmod(path, 0o777)

    # Before: this save was stored in the other user's directory (200).
    assert put(agent, "job", 0, 2, os.urandom(50_000)).status_code == 500
    assert sorted(str(p.relative_to(node_dir)) for p in node_dir.rglob("*")) == [
        "job",
        "job/0",
        "job/0/999.meta",
        "job/0/999.shard",
    ]
    assert 999 not in latest(agent, "job")
    assert get(agent, "job", 0, 999).status_code == 404

    log = tmp_path / "restarted.log"
    restarted = restart_agent(agent_plane, node_id, log)
    try:
        # Before: it adopted 999 and served it. Now it refuses to start, and says why.
        assert restarted.wait(timeout=60) == 1
        assert (
            f"refusing to start: {node_dir} belongs to uid {NOBODY}, not to this process's user (uid 0)"
            in log.read_text()
        )
    finally:
        restarted.kill()
        restarted.wait(timeout=30)
