"""Finding 6 of issue 12: an agent killed by SIGBUS.

The same-host fast path hands a trainer the path of a file in the agent's shared memory; the
trainer fills it and asks for a commit. The attack: reserve, truncate the file (or swap it for a
link, another file, a moved directory), commit. The agent must answer 400 and give the
reservation back, stay alive and keep serving what it held.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane
from tests.tier import cluster, create_namespace, get, metric, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


def reserve(agent: str, rank: int, step: int, size: int) -> dict[str, Any]:
    response = httpx.post(f"{agent}/v1/fast/reserve/job/{rank}/{step}", params={"size": size})
    assert response.status_code == 200, response.text
    doc: dict[str, Any] = response.json()
    return doc


def commit(agent: str, token: str) -> httpx.Response:
    return httpx.post(f"{agent}/v1/fast/commit/{token}")


def test_a_truncated_or_swapped_fast_path_file_is_refused(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "sigbus", 1))
    assert create_namespace(a, "job", 2).status_code == 201
    good = os.urandom(300_000)
    assert put(a, "job", 0, 1, good).status_code == 200
    held = metric(a, "hpsim_tier_bytes_held")
    outside = tmp_path / "outside"
    outside.write_bytes(b"o" * 4096)

    def truncate(path: Path) -> None:  # the attack of the finding
        os.truncate(path, 0)

    def shorten(path: Path) -> None:
        os.truncate(path, 100)

    def symlink(path: Path) -> None:
        path.unlink()
        path.symlink_to(outside)

    def other_file(path: Path) -> None:
        swapped = path.with_name("swapped")
        swapped.write_bytes(b"s" * 4096)
        os.replace(swapped, path)

    def hard_link(path: Path) -> None:
        os.link(path, path.with_name("alias"))  # a second name, kept when the agent unlinks its own

    def fifo(path: Path) -> None:
        path.unlink()
        os.mkfifo(path)

    def moved_directory(path: Path) -> None:
        # The rank's directory is moved out of the agent's root and a link left in its place.
        # (Beside the node's directory: a rename stays on one file system.)
        rank_dir = path.parent
        moved = rank_dir.parents[2] / "moved"
        rank_dir.rename(moved)
        rank_dir.symlink_to(moved)

    attacks = {
        truncate: "holds 0 bytes, not the 4096 reserved",
        shorten: "holds 100 bytes",
        symlink: "cannot be opened",
        other_file: "replaced by another file",
        hard_link: "has 2 names",
        fifo: "not a regular file",
        moved_directory: "no longer under the agent's root",
    }
    for step, (attack, problem) in enumerate(attacks.items(), start=10):
        doc = reserve(a, 1, step, 4096)
        path = Path(doc["path"])
        with open(path, "r+b") as handle:
            handle.write(b"x" * 4096)
        attack(path)
        refused = commit(a, doc["token"])
        assert refused.status_code == 400, (attack.__name__, refused.text)
        assert refused.json()["error"] == "UnusableShardFile"
        assert problem in refused.json()["message"], (attack.__name__, refused.json())
        # The reservation was given back: its token is gone and its bytes are free again.
        assert commit(a, doc["token"]).status_code == 404
        assert metric(a, "hpsim_tier_bytes_held") == held, attack.__name__
        assert httpx.get(f"{a}/health").json()["status"] == "ok"
        assert get(a, "job", 1, step).status_code == 404

    # The agent is alive, serves what it held byte for byte, and takes a proper fast-path write
    # (into a directory of its own again: the link left by the last attack is gone).
    assert get(a, "job", 0, 1).content == good
    fresh = os.urandom(50_000)
    doc = reserve(a, 1, 1, len(fresh))
    with open(doc["path"], "r+b") as handle:
        handle.write(fresh)
    assert commit(a, doc["token"]).status_code == 200
    assert get(a, "job", 1, 1).content == fresh
    assert not Path(doc["path"]).parent.is_symlink()
    assert httpx.get(f"{a}/v1/cp/checkpoints/job/latest").json() == [1]
