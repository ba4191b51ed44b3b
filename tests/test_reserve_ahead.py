"""Issue 18, the stall's fixed part: a trainer's next same-host write is reserved when its last one
is committed (off the training thread), so the next save's staging starts copying at once. The
write is held under a placeholder step and committed as the step saved; given back unused or
expired it stays its rank's spare; lost (the agent restarted) the save is written again. No
timing here (bench/checkpoint_path.py measures the stalls)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save

from hyperpod_sim.agents.fastpath import FastPath
from hyperpod_sim.agents.store import ReservationCancelled, ShardKey, ShardStore
from hyperpod_sim.agents.tiermodel import Namespace
from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageReader, TieredStorageWriter
from tests.clocks import ManualClock, StepClock
from tests.conftest import ControlPlane
from tests.store import read
from tests.tier import cluster, create_namespace, latest, metric, url

pytestmark = pytest.mark.patient_heartbeats

KiB = 1 << 10
MiB = 1 << 20


def commit(store: ShardStore, step: int, data: bytes, *, keep: int, ahead: Any = None) -> Any:
    """One save as the agent makes it with a write reserved ahead: the held write (or a new one)
    becomes ``step``; then retention, the spares and the rank's next write, reserved ahead."""
    if ahead is None:
        ahead = store.reserve(ShardKey("job", 0, step), len(data))
    else:
        ahead.rebind(step)
    with ahead.buffer() as view:
        view[:] = data
    ahead.commit(checksum=checksum_of(data))
    store.enforce_retention("job", keep)
    store.prepare_spares("job", 0, files=keep + 1)
    return store.reserve(ShardKey("job", 0, step + 1), len(data), ahead=True)


def files_of_rank(store: ShardStore) -> int:
    return len(store.shards("job")) + len(store.spares("job"))


def test_a_write_reserved_ahead_is_committed_as_the_step_saved(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "node", budget_bytes=MiB, clock=StepClock())
    ahead = store.reserve(ShardKey("job", 0, 2), 64 * KiB, ahead=True)
    ahead.rebind(7)  # the trainer saved step 7, not the placeholder
    with ahead.buffer() as view:
        view[:] = b"\x07" * 64 * KiB
    ahead.commit(checksum=checksum_of(b"\x07" * 64 * KiB))
    assert sorted(store.steps("job")) == [7]
    assert read(store, ShardKey("job", 0, 7)) == b"\x07" * 64 * KiB


def test_the_rotation_holds_the_write_ahead_and_stops_allocating(tmp_path: Path) -> None:
    """Retention 3: three steps, the write ahead and one spare, for a trainer that starts over
    (its first save then finds a file in place); from the third save on nothing is allocated."""
    size = 64 * KiB
    store = ShardStore(tmp_path / "node", budget_bytes=16 * size, clock=StepClock())
    written: dict[int, bytes] = {}
    ahead = None
    buffers = set()
    for step in range(1, 13):
        written[step] = os.urandom(size)
        ahead = commit(store, step, written[step], keep=3, ahead=ahead)
        buffers.add(ahead.buffer_id)
        for held in store.shards("job"):
            assert read(store, held.key) == written[held.key.step]
        if step >= 3:
            assert files_of_rank(store) + 1 == 5  # + the write ahead
            assert store.prepare_spares("job", 0, files=4) == 0
    assert sorted(store.steps("job")) == [10, 11, 12]
    assert len(buffers) == 5  # the same five files went round
    assert store.in_use_bytes == 5 * size


def test_a_write_ahead_given_back_stays_the_ranks_spare(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "node", budget_bytes=MiB, clock=StepClock())
    ahead = commit(store, 1, b"\x01" * 64 * KiB, keep=3)
    before = store.in_use_bytes
    ahead.abort(keep_as_spare=4)
    assert ahead.buffer_id in {s.buffer_id for s in store.spares("job")}
    assert store.in_use_bytes == before  # its memory is kept, as a spare, not allocated again
    spares = {s.buffer_id for s in store.spares("job")}
    assert store.reserve(ShardKey("job", 0, 2), 64 * KiB).buffer_id in spares


def test_a_write_ahead_a_trainer_swapped_or_cut_is_not_kept(tmp_path: Path) -> None:
    """The trainer can write the rank's directory: a file it replaced by a link, or cut short,
    is deleted at the give-back, never kept as a spare (or followed)."""
    store = ShardStore(tmp_path / "node", budget_bytes=MiB, clock=StepClock())
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    linked = store.reserve(ShardKey("job", 0, 2), 64 * KiB, ahead=True)
    linked.path.unlink()
    linked.path.symlink_to(outside)
    linked.abort(keep_as_spare=4)
    cut = store.reserve(ShardKey("job", 1, 2), 64 * KiB, ahead=True)
    os.truncate(cut.path, 10)
    cut.abort(keep_as_spare=4)
    assert store.spares("job") == []
    assert not linked.path.is_symlink()
    assert not cut.path.exists()
    assert outside.read_bytes() == b"keep me"
    assert store.in_use_bytes == 0


def test_a_write_ahead_of_a_namespace_reset_meanwhile_is_not_committed(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "node", budget_bytes=MiB, clock=StepClock())
    ahead = commit(store, 1, b"\x01" * 64 * KiB, keep=3)
    store.delete_namespace("job")
    with pytest.raises(ReservationCancelled):
        ahead.rebind(2)
    ahead.abort(keep_as_spare=4)
    assert not store.steps("job")
    assert store.spares("job") == []


def test_an_expired_write_ahead_is_kept_as_the_ranks_spare(tmp_path: Path) -> None:
    async def scenario() -> None:
        manual = ManualClock()
        tasks: list[asyncio.Future[None]] = []

        def spawn(coroutine: Awaitable[None]) -> None:
            tasks.append(asyncio.ensure_future(coroutine))

        store = ShardStore(tmp_path / "shm", budget_bytes=4 * MiB)
        fast = FastPath(clock=manual.clock(), timeout_s=10.0, spawn=spawn)
        ahead = store.reserve(ShardKey("job", 0, 2), MiB, ahead=True)
        plain = store.reserve(ShardKey("job", 1, 2), MiB)
        fast.open_write(ahead, Namespace("job", 2, 3))
        fast.open_write(plain, Namespace("job", 2, 3))
        await asyncio.gather(*tasks)  # the trainer never came back for either
        # The write ahead is one of its rank's files; the other is given back as before.
        assert [s.buffer_id for s in store.spares("job")] == [ahead.buffer_id]
        assert store.in_use_bytes == MiB

    asyncio.run(scenario())


# -- through a real agent


def reserve(agent: str, step: int, size: int, **params: str) -> httpx.Response:
    return httpx.post(f"{agent}/v1/fast/reserve/job/0/{step}", params={"size": size, **params})


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_agent_commits_a_write_ahead_as_the_step_named_and_checks_the_call(
    agent_plane: ControlPlane, tmp_path: Path
) -> None:
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "ahead", 1))
    assert create_namespace(a, "job", 1, steps_retained=3).status_code == 201
    doc = reserve(a, 2, 4096, ahead="true").json()
    assert doc["expires_in_s"] > 0
    with open(doc["path"], "r+b") as handle:
        handle.write(b"\x05" * 4096)
    answer = httpx.post(f"{a}/v1/fast/commit/{doc['token']}", params={"step": 5})
    assert answer.status_code == 200, answer.text
    assert answer.json()["step"] == 5
    assert latest(a, "job") == [5]  # never the placeholder

    # A step is named only for a write reserved ahead; a bad one gives the write back.
    plain = reserve(a, 6, 4096).json()
    refused = httpx.post(f"{a}/v1/fast/commit/{plain['token']}", params={"step": 9})
    assert refused.status_code == 400
    assert refused.json()["error"] == "InvalidParameter"
    bad = reserve(a, 7, 4096, ahead="true").json()
    refused = httpx.post(f"{a}/v1/fast/commit/{bad['token']}", params={"step": "-1"})
    assert refused.status_code == 400
    assert httpx.post(f"{a}/v1/fast/commit/{bad['token']}").status_code == 404  # given back
    assert reserve(a, 8, 4096, ahead="yes").status_code == 400
    assert latest(a, "job") == [5]
    assert metric(a, "hpsim_tier_bytes_held") <= metric(a, "hpsim_tier_budget_bytes")


def state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"model": {f"w{i}": torch.randn(64, 256) for i in range(4)}, "step": step}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_saves_with_the_write_ahead_load_back_and_survive_its_loss(agent_plane: ControlPlane) -> None:
    """Steps saved at irregular intervals land as themselves; when the agent gives up the write
    held ahead (as a restarted agent has), the next save is still complete and loads back."""
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "ahead-sdk", 1))
    config = TieredCheckpointConfig(namespace="sdkjob", world_size=1, agent_url=a, fast_path=True)
    client = config.client()
    for step in (10, 20, 35):
        async_save(state(step), storage_writer=TieredStorageWriter(config, step=step)).result()
        assert ("sdkjob", 0) in client._ahead  # the next write is held
    assert latest(a, "sdkjob") == [35, 20, 10]
    # The agent loses the write held ahead (its token is no longer known there).
    held = client._ahead[("sdkjob", 0)]
    assert httpx.post(f"{a}/v1/fast/abort/{held.token}").json() == {"aborted": True}
    async_save(state(40), storage_writer=TieredStorageWriter(config, step=40)).result()
    assert latest(a, "sdkjob")[0] == 40
    for step in (20, 35, 40):
        target = {"model": {f"w{i}": torch.empty(64, 256) for i in range(4)}, "step": -1}
        load(target, storage_reader=TieredStorageReader(config, step=step))
        expected = state(step)
        assert target["step"] == step
        assert all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())
