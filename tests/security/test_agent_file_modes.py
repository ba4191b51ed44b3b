"""Finding 9 of issue 12 (files): the shard files were world-readable (0644).

Everything an agent writes under its shared-memory directory (the directory itself, namespace
and rank directories, shards, sidecars, replicas, same-host writes) is its user's only: 0700 for
directories, 0600 for files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane, shm_root_for, wait_for
from tests.tier import cluster, create_namespace, get, put, replicated, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def test_shard_files_and_directories_are_owner_only(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    nodes = cluster(sm, agent_plane, "modes", 2)
    a, b = (url(n) for n in nodes)
    assert create_namespace(a, "job", 2).status_code == 201
    shards = {rank: os.urandom(120_000 + rank) for rank in range(2)}
    assert put(a, "job", 0, 1, shards[0]).status_code == 200  # over HTTP
    reserved = httpx.post(f"{a}/v1/fast/reserve/job/1/1", params={"size": len(shards[1])}).json()
    assert stat.S_IMODE(os.stat(reserved["path"]).st_mode) == 0o600  # handed to the trainer so
    with open(reserved["path"], "r+b") as handle:
        handle.write(shards[1])
    assert httpx.post(f"{a}/v1/fast/commit/{reserved['token']}").status_code == 200
    wait_for(lambda: replicated(a), timeout=30, what="the replicas on b")

    seen: dict[str, int] = {}
    for node in nodes:
        root = shm_root_for(tmp_path) / node["InstanceId"]
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        for directory, subdirs, files in os.walk(root):
            for name in subdirs:
                mode = stat.S_IMODE((Path(directory) / name).stat().st_mode)
                assert mode == 0o700, (directory, name, oct(mode))
            for name in files:
                mode = stat.S_IMODE((Path(directory) / name).stat().st_mode)
                assert mode == 0o600, (directory, name, oct(mode))
                kind = "spare" if name.endswith(".spare") else name
                seen[kind] = seen.get(kind, 0) + 1
    # Both ranks' shards and sidecars, on the owner and on its replica peer; on the owner, each
    # rank's spares for its next saves (owner-only too).
    assert seen == {"1.shard": 4, "1.meta": 4, "spare": 6}
    for agent in (a, b):
        for rank, data in shards.items():
            assert get(agent, "job", rank, 1).content == data
