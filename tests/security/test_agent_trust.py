"""Issue 23 ("Trust, second round"), the node agents' findings, each attack made with raw HTTP
against real agent processes:

- (a) in Token mode the fast path's alias under ``/v1/cp/fast/...`` answered a shard's path,
  checksum and a lease without the token, and leases (and open writes) had no bound;
- (b) namespace creations had no cap per cluster, and a namespace of a million ranks was accepted;
- (d) a namespace name with a NUL was saved, and its S3 persist could never succeed
  (tests/security/test_agent_names.py, with an S3 tier);
- (f) a full shared-memory tmpfs made saves answer 500 instead of the documented 507.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControlPlane, shm_root_for
from tests.security.access import set_access
from tests.tier import cluster, create_namespace, get, latest, metric, put, url

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.patient_heartbeats,
]


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


# ------------------------------------------------------------------ (a) the fast path's alias, leases


def test_the_cp_alias_of_the_fast_path_needs_the_checkpoint_token(agent_plane: ControlPlane, sm: Any) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "alias", 1))
    set_access(agent_plane, sm, "alias", [a], "Token")
    token = httpx.get(f"{agent_plane.url}/clusters/alias/checkpoint-token").json()["CheckpointToken"]
    auth = {"Authorization": f"Bearer {token}"}
    created = httpx.post(f"{a}/v1/cp/namespaces/job", params={"num_ranks": 1}, headers=auth)
    assert created.status_code == 201, created.text
    data = os.urandom(200_000)
    assert put(a, "job", 0, 1, data, **auth).status_code == 200

    for prefix in ("/v1/fast", "/v1/cp/fast"):
        anonymous = httpx.get(f"{a}{prefix}/shards/job/0/1")
        assert anonymous.status_code == 401, (prefix, anonymous.text)
        assert anonymous.json()["error"] == "MissingToken"
        assert "lease" not in anonymous.json()
        assert "path" not in anonymous.json()
        wrong = httpx.get(f"{a}{prefix}/shards/job/0/1", headers={"Authorization": "Bearer not-it"})
        assert wrong.status_code == 403, (prefix, wrong.text)
        # Every other fast-path route under the alias is behind the token too.
        for method, path in (("POST", "reserve/job/0/2?size=4"), ("POST", "release/0123456789abcdef")):
            assert httpx.request(method, f"{a}{prefix}/{path}").status_code == 401, (prefix, path)
        held = httpx.get(f"{a}{prefix}/shards/job/0/1", headers=auth)
        assert held.status_code == 200, (prefix, held.text)
        assert held.json()["size"] == len(data)
        released = httpx.post(f"{a}{prefix}/release/{held.json()['lease']}", headers=auth)
        assert released.json() == {"released": True}
    # Reads of the library's protocol stay open, as documented.
    assert get(a, "job", 0, 1).content == data


def test_fast_path_leases_and_open_writes_are_capped_per_agent(
    agent_plane: ControlPlane, sm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPSIM_AGENT_MAX_FAST_LEASES", "4")  # the agents started from now on
    (a,) = (url(n) for n in cluster(sm, agent_plane, "leases", 1))
    assert create_namespace(a, "job", 1).status_code == 201
    data = os.urandom(100_000)
    assert put(a, "job", 0, 1, data).status_code == 200

    leases = []
    for _ in range(4):
        held = httpx.get(f"{a}/v1/fast/shards/job/0/1")
        assert held.status_code == 200, held.text
        leases.append(held.json()["lease"])
    # The flood of the finding: locates never released. The fifth is refused, nothing pinned.
    for prefix in ("/v1/fast", "/v1/cp/fast"):
        refused = httpx.get(f"{a}{prefix}/shards/job/0/1")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"] == "ResourceLimitExceeded"
        assert "its limit is 4" in refused.json()["message"]
    assert httpx.post(f"{a}/v1/fast/release/{leases.pop()}").json() == {"released": True}
    again = httpx.get(f"{a}/v1/fast/shards/job/0/1")
    assert again.status_code == 200, again.text
    leases.append(again.json()["lease"])

    # Open writes are bounded the same way (a reservation of 0 bytes costs no budget).
    tokens = []
    for step in range(2, 6):
        reserved = httpx.post(f"{a}/v1/fast/reserve/job/0/{step}", params={"size": 0})
        assert reserved.status_code == 200, reserved.text
        tokens.append(reserved.json()["token"])
    refused = httpx.post(f"{a}/v1/fast/reserve/job/0/9", params={"size": 0})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"] == "ResourceLimitExceeded"
    for token in tokens:
        assert httpx.post(f"{a}/v1/fast/abort/{token}").json() == {"aborted": True}
    for lease in leases:
        assert httpx.post(f"{a}/v1/fast/release/{lease}").json() == {"released": True}
    assert httpx.post(f"{a}/v1/fast/reserve/job/0/9", params={"size": 0}).status_code == 200
    assert get(a, "job", 0, 1).content == data


# ------------------------------------------------------------------ (b) namespaces and ranks


@pytest.mark.parametrize("agent_settings", [{"limits": {"max_namespaces_per_cluster": 5}}], indirect=True)
def test_a_flood_of_namespace_creations_stops_at_the_cluster_limit(
    agent_plane: ControlPlane, sm: Any
) -> None:
    a, b = (url(n) for n in cluster(sm, agent_plane, "spam", 2))
    answers = [create_namespace(a if n % 2 else b, f"spam{n}", 3) for n in range(8)]
    assert [r.status_code for r in answers] == [201] * 5 + [400] * 3
    assert answers[5].json() == {
        "error": "ResourceLimitExceeded",
        "message": "The cluster 'spam' already has 5 checkpoint namespaces, the limit is 5. "
        "Delete a namespace it no longer needs.",
    }
    assert httpx.get(f"{a}/v1/cp/namespaces/spam5").status_code == 404
    # An existing name is still a 409, and deleting one makes room again.
    assert create_namespace(b, "spam0", 3).status_code == 409
    assert httpx.delete(f"{a}/v1/cp/namespaces/spam0").status_code == 200
    assert create_namespace(b, "spam5", 3).status_code == 201


def test_num_ranks_out_of_range_is_a_validation_error(agent_plane: ControlPlane, sm: Any) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "ranks", 1))
    # The finding's call: a million ranks, over the control plane's default limit (65,537).
    huge = create_namespace(a, "huge", 1_000_000)
    assert huge.status_code == 400, huge.text
    assert huge.json() == {
        "error": "ValidationException",
        "message": "1 validation error detected: Value '1000000' at 'numRanks' failed to satisfy "
        "constraint: Member must have value less than or equal to 65537",
    }
    # Past the protocol's ceiling, refused by the agent itself; and no ranks at all.
    for num_ranks, constraint in (
        (1_000_001, "less than or equal to 1000000"),
        (0, "greater than or equal to 1"),
    ):
        refused = create_namespace(a, "huge", num_ranks)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == "ValidationException"
        assert refused.json()["message"].endswith(f"Member must have value {constraint}")
    assert httpx.get(f"{a}/v1/cp/namespaces/huge").status_code == 404
    assert create_namespace(a, "huge", 65_537).status_code == 201  # the limit itself is allowed


# ------------------------------------------------------------------ (f) a full shared memory

SMALL_TMPFS = 4 * 1024 * 1024


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted where this test's agents keep their shared memory (root only); the
    agents' budget (hundreds of MiB) is far larger, so the tmpfs fills before the budget does."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    root = shm_root_for(tmp_path)
    root.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS},mode=0700", "tmpfs", str(root)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        root.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield root
    finally:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], check=False)
        with contextlib.suppress(OSError):
            root.rmdir()


def files_under(root: Path, *, besides: Path | None = None) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir() and p != besides)


def free_bytes(root: Path) -> int:
    stat = os.statvfs(root)
    return stat.f_bavail * stat.f_frsize


def fill(root: Path, *, leave: int) -> Path:
    """A file taking all of the tmpfs's free room but ``leave`` bytes."""
    filler = root / "filler"
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free_bytes(root) - leave)
    finally:
        os.close(fd)
    assert free_bytes(root) == leave
    return filler


def test_a_full_tmpfs_answers_507_and_leaves_nothing_half_written(
    small_shm: Path, agent_plane: ControlPlane, sm: Any
) -> None:
    (a,) = (url(n) for n in cluster(sm, agent_plane, "full", 1))
    assert create_namespace(a, "job", 1).status_code == 201
    assert metric(a, "hpsim_tier_budget_bytes") > 10 * SMALL_TMPFS
    too_big = os.urandom(SMALL_TMPFS + 4096)

    def nothing_stored() -> None:
        assert files_under(small_shm, besides=small_shm / "filler") == []
        assert metric(a, "hpsim_tier_bytes_held") == 0
        assert get(a, "job", 0, 1).status_code == 404

    # Within the budget, over the tmpfs: the shard's own file cannot be allocated.
    upload = put(a, "job", 0, 1, too_big)
    assert upload.status_code == 507, upload.text
    assert upload.json()["error"] == "InsufficientStorage"
    assert "nothing was stored" in upload.json()["message"]
    reserved = httpx.post(f"{a}/v1/fast/reserve/job/0/1", params={"size": len(too_big)})
    assert reserved.status_code == 507, reserved.text
    nothing_stored()

    # The shard's bytes fit exactly, its sidecar (written at the commit) does not.
    page_sized = os.urandom(64 * 4096)
    filler = fill(small_shm, leave=len(page_sized))
    upload = put(a, "job", 0, 1, page_sized)
    assert upload.status_code == 507, upload.text
    assert upload.json()["error"] == "InsufficientStorage"
    nothing_stored()
    # The same on the fast path: its commit writes the sidecar.
    reserved = httpx.post(f"{a}/v1/fast/reserve/job/0/1", params={"size": len(page_sized)})
    assert reserved.status_code == 200, reserved.text
    with open(reserved.json()["path"], "r+b") as trainer:  # what a trainer on this host does
        trainer.write(page_sized)
    committed = httpx.post(f"{a}/v1/fast/commit/{reserved.json()['token']}")
    assert committed.status_code == 507, committed.text
    assert committed.json()["error"] == "InsufficientStorage"
    nothing_stored()

    # Room again: a save that fits is stored and served.
    filler.unlink()
    fits = os.urandom(300_000)
    assert put(a, "job", 0, 1, fits).status_code == 200
    assert get(a, "job", 0, 1).content == fits
    assert latest(a, "job") == [1]
