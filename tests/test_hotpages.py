"""Pages a policy push writes, kept out of same-page merging (agents/launcher/hotpages.py).

The pages a piece of work writes are found with a stopped twin and the pagemap's "exclusively
mapped" bit and marked unmergeable; the pages it did not write stay mergeable. The twin shows no
agent's command line and dies with its parent. An agent's push to itself is answered as a push is,
on a connection it greeted itself on, and not counted as one of the control plane's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from hyperpod_sim.agents.app import AgentApp
from hyperpod_sim.agents.http.server import HttpServer
from hyperpod_sim.agents.launcher import hotpages
from hyperpod_sim.agents.main import bind
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.contracts.agent_api import CONTROL_PLANE_AGENT, POLICY_PATH
from hyperpod_sim.infra.processes import command_line, find_agent_pids
from tests.conftest import wait_for

PR_SET_MEMORY_MERGE = 67
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")


def can_mark_mergeable() -> str | None:
    """Why a child process cannot mark its memory mergeable here; None when it can."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
            f"print(libc.prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0), os.strerror(ctypes.get_errno()))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    code, _, reason = probe.stdout.strip().partition(" ")
    if code == "0":
        return None
    return f"prctl(PR_SET_MEMORY_MERGE): {reason} (it needs Linux 6.4 or later and CAP_SYS_RESOURCE)"


def vma_flags(smaps: str, address: int) -> set[str]:
    """The VmFlags of the mapping of ``address`` in a ``/proc/<pid>/smaps`` text."""
    inside = False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and ":" not in head:
            start, _, end = head.partition("-")
            inside = int(start, 16) <= address < int(end, 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


WRITER = textwrap.dedent(
    """
    import asyncio, ctypes, json, mmap, sys
    from hyperpod_sim.agents.launcher import hotpages

    libc = ctypes.CDLL(None, use_errno=True)
    assert not hotpages.mergeable()  # a process nobody marked
    assert libc.prctl(67, 1, 0, 0, 0) == 0, "PR_SET_MEMORY_MERGE"
    assert hotpages.mergeable()
    PAGE = hotpages.PAGE
    buffer = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(64):
        buffer[i * PAGE] = 1  # present and this process's own before the twin
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))

    async def work():
        await asyncio.sleep(0)
        for i in range(10, 20):
            buffer[i * PAGE] = 2

    unmerged = asyncio.run(hotpages.unmerge_written(work))
    smaps = open("/proc/self/smaps").read()
    children = open(f"/proc/self/task/{__import__('os').getpid()}/children").read().split()
    print(json.dumps({"base": base, "pages": unmerged.pages, "runs": unmerged.runs,
                      "refused": unmerged.refused, "smaps": smaps, "children": children}))
    """
)


@LINUX
def test_the_pages_a_piece_of_work_writes_are_kept_out_of_merging_and_no_other() -> None:
    reason = can_mark_mergeable()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run([sys.executable, "-c", WRITER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    page, base, smaps = hotpages.PAGE, found["base"], found["smaps"]
    written = [base + i * page for i in range(10, 20)]
    untouched = [base + i * page for i in (*range(10), *range(20, 64))]
    # What a user's ksmd will merge and will not: the written pages' mappings lost "mg".
    assert all("mg" not in vma_flags(smaps, address) for address in written)
    assert all("mg" in vma_flags(smaps, address) for address in untouched)
    assert found["pages"] >= len(written)
    assert found["refused"] == 0
    assert found["children"] == []  # the twin was killed and collected


TWIN_HOLDER = textwrap.dedent(
    """
    import sys, time
    from hyperpod_sim.agents.launcher import hotpages

    with hotpages.stopped_twin() as twin:
        print(twin, flush=True)
        time.sleep(300)
    """
)


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (None: no such process)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw.rsplit(b")", 1)[1].split()[0].decode()


@LINUX
def test_the_twin_is_stopped_shows_no_agents_command_line_and_dies_with_its_parent() -> None:
    node_id = "i-0123456789abcdef0"
    # A command line that observers take for node_id's agent (an argument ending in "agent").
    holder = subprocess.Popen(
        [sys.executable, "-c", TWIN_HOLDER, "agent", "--node-id", node_id],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        twin = int(holder.stdout.readline())
        assert process_state(twin) == "T"
        assert command_line(twin) == [hotpages.TWIN_TITLE]
        assert find_agent_pids(node_id) == [holder.pid]
        holder.send_signal(signal.SIGKILL)  # as a kill -9 of the agent in the middle of it
        holder.wait(timeout=30)
        wait_for(lambda: process_state(twin) in (None, "Z"), timeout=30, what="the twin's death")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


def a_policy(generation: int, node_id: str) -> dict[str, Any]:
    return {
        "generation": generation,
        "cluster_name": "hot",
        "cluster_id": "abcdefghijkl",
        "node_id": node_id,
        "instance_group": "workers",
        "instance_type": "ml.p5.48xlarge",
        "tiered_storage": {"enabled": True, "memory_percentage": 20},
        "memory_budget_bytes": 1024 * 1024,
        "in_memory_retention": 3,
        "replication": {"factor": 1, "peers": []},
        "s3": None,
    }


@LINUX
def test_an_agents_push_to_itself_is_answered_and_not_counted_as_the_control_planes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node_id = "i-0123456789abcdef0"
    token = "control-plane-secret-0246"
    state = AgentState(cluster="hot", node_id=node_id)
    state.mark_registered(
        node_id=node_id,
        cluster_token=SecretStr("cluster-secret-1234"),
        node_token=SecretStr("node-secret-5678"),
        control_plane_token=SecretStr(token),
    )
    assert state.apply_policy(a_policy(3, node_id)).applied_generation == 3
    sock = bind(host="127.0.0.1", port=0)

    async def scenario() -> tuple[hotpages.Unmerged | None, int]:
        server = HttpServer(handler=AgentApp(state=state), sock=sock)
        await server.start()
        try:
            unmerged = await hotpages.keep_push_pages_unmerged(state, sock.getsockname())
            async with httpx.AsyncClient() as client:
                answer = await client.put(
                    f"http://127.0.0.1:{sock.getsockname()[1]}{POLICY_PATH}",
                    json=a_policy(3, node_id),
                    headers={"Authorization": f"Bearer {token}", "User-Agent": CONTROL_PLANE_AGENT},
                )
            return unmerged, answer.status_code
        finally:
            await server.close()

    caplog.set_level("INFO", logger="agents.hotpages")
    try:
        unmerged, status = asyncio.run(scenario())
    finally:
        sock.close()
    assert unmerged is not None
    assert unmerged.pages > 0  # a push writes pages: found
    assert "the push to itself answered 200" in caplog.text
    assert state.applied_generation == 3  # the policy in force, applied as unchanged
    # Only the control plane's push counts (hpsim_agent_policy_pushes_total).
    assert status == 200
    assert state.counters.policy_pushes_total == 1
    assert Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split() == []  # no twin left


def test_an_agent_without_a_policy_pushes_nothing_to_itself() -> None:
    state = AgentState(cluster="hot", node_id=None)
    assert asyncio.run(hotpages.keep_push_pages_unmerged(state, ("127.0.0.1", 9))) is None


def test_page_runs_join_adjacent_pages() -> None:
    page = hotpages.PAGE
    pages = {10 * page, 11 * page, 12 * page, 20 * page, 22 * page, 23 * page}
    expected = [(10 * page, 3 * page), (20 * page, page), (22 * page, 2 * page)]
    assert list(hotpages.page_runs(pages)) == expected
    assert list(hotpages.page_runs(set())) == []


def test_only_private_writable_mappings_are_watched() -> None:
    maps = textwrap.dedent(
        """\
        55d0c0000000-55d0c0001000 r--p 00000000 08:01 1 /usr/bin/python3.11
        55d0c0001000-55d0c0003000 rw-p 00001000 08:01 1 /usr/bin/python3.11
        55d0c1000000-55d0c1200000 rw-p 00000000 00:00 0 [heap]
        7f0000000000-7f0000100000 rw-s 00000000 00:05 7 /dev/shm/x
        7f0000100000-7f0000200000 rw-p 00000000 00:00 0
        7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
        7ffd00100000-7ffd00102000 r--p 00000000 00:00 0 [vvar]
        7ffd00102000-7ffd00104000 r-xp 00000000 00:00 0 [vdso]
        """
    )
    assert hotpages.private_writable_ranges(maps) == [
        (0x55D0C0001000, 0x55D0C0003000),
        (0x55D0C1000000, 0x55D0C1200000),
        (0x7F0000100000, 0x7F0000200000),
        (0x7FFD00000000, 0x7FFD00021000),
    ]
