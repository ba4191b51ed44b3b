"""Issue 18, "no warm-up": a rank's rotation of buffers (retention + 1 files) is made after its
first save, allocated and faulted in, within the memory budget; a retained step's bytes are never
handed out; an agent that restarts finds its spares. No timing here (bench/checkpoint_path.py
measures the stalls)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.agents.store import ShardKey, ShardStore
from hyperpod_sim.contracts.shards import checksum_of
from tests.clocks import StepClock
from tests.conftest import ControlPlane
from tests.store import read
from tests.tier import cluster, create_namespace, get, metric, url

pytestmark = pytest.mark.patient_heartbeats

KiB = 1 << 10
MiB = 1 << 20


def save(store: ShardStore, step: int, data: bytes, *, keep: int, rank: int = 0) -> str:
    """One save as the agent makes it: reserve, write, commit, retention, then the spares.
    Returns the buffer id the save was given."""
    reservation = store.reserve(ShardKey("job", rank, step), len(data))
    buffer_id = reservation.buffer_id
    with reservation.buffer() as view:
        view[:] = data
    reservation.commit(checksum=checksum_of(data))
    store.enforce_retention("job", keep)
    store.prepare_spares("job", rank, files=keep + 1)
    return buffer_id


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


def test_the_first_save_prepares_the_rotation_and_the_next_saves_use_it(
    tmp_path: Path, clock: StepClock
) -> None:
    store = ShardStore(tmp_path / "node", budget_bytes=10 * 64 * KiB, clock=clock)
    first = save(store, 1, b"\x01" * 64 * KiB, keep=3)
    spares = store.spares("job")
    assert len(spares) == 3  # retention 3: three more files for saves 2, 3 and 4
    assert all(s.size == 64 * KiB and allocated(s.path) >= 64 * KiB for s in spares)
    assert store.spare_bytes == 3 * 64 * KiB
    assert store.in_use_bytes == 4 * 64 * KiB
    handed = [save(store, step, bytes([step]) * 64 * KiB, keep=3) for step in (2, 3, 4)]
    assert handed == [s.buffer_id for s in spares]
    # Four files: steps 2-4 retained, step 1's aged out and is the next save's.
    assert [s.buffer_id for s in store.spares("job")] == [first]
    assert save(store, 5, b"\x05" * 64 * KiB, keep=3) == first
    assert [s.buffer_id for s in store.spares("job")] == [handed[0]]
    assert store.in_use_bytes == 4 * 64 * KiB
    assert sorted(store.steps("job")) == [3, 4, 5]


def test_spares_stay_within_the_budget_and_give_way_to_real_saves(tmp_path: Path, clock: StepClock) -> None:
    size = 64 * KiB
    tight = ShardStore(tmp_path / "tight", budget_bytes=size, clock=clock)
    save(tight, 1, b"\x01" * size, keep=3)
    assert tight.spares() == []  # no room for any: none, and saves go on
    for step in (2, 3, 4):
        save(tight, step, bytes([step]) * size, keep=3)
        assert read(tight, ShardKey("job", 0, step)) == bytes([step]) * size
        assert tight.in_use_bytes <= tight.budget_bytes

    some = ShardStore(tmp_path / "some", budget_bytes=2 * size + size // 2, clock=clock)
    save(some, 1, b"\x01" * size, keep=3)
    assert len(some.spares()) == 1
    assert some.in_use_bytes <= some.budget_bytes

    # Another namespace needs the room: the spare goes, no step is evicted.
    reservation = some.reserve(ShardKey("other", 0, 1), size + size // 2)
    reservation.abort()
    assert some.spares() == []
    assert some.steps("job") == {1: {0}}

    # A budget that shrinks drops spares before shards.
    roomy = ShardStore(tmp_path / "roomy", budget_bytes=8 * size, clock=clock)
    save(roomy, 1, b"\x01" * size, keep=3)
    assert len(roomy.spares()) == 3
    assert roomy.set_budget(2 * size) == []
    assert len(roomy.spares()) == 1
    assert roomy.steps("job") == {1: {0}}


def test_retained_steps_are_never_overwritten_across_many_saves(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path / "node", budget_bytes=64 * 32 * KiB, clock=clock)
    written: dict[tuple[int, int], bytes] = {}
    for step in range(1, 25):
        keep = 3 if step < 12 else 2  # the retention changes midway
        for rank in (0, 1):
            data = os.urandom(32 * KiB + step)  # sizes vary a little, as a state's values do
            save(store, step, data, keep=keep, rank=rank)
            written[(step, rank)] = data
            for held in store.shards("job"):
                assert read(store, held.key) == written[(held.key.step, held.key.rank)]
    assert sorted(store.steps("job")) == [23, 24]
    # Each rank keeps at most retention + 1 files.
    assert all(len([s for s in store.spares() if s.rank == r]) <= 1 for r in (0, 1))


def test_a_restarted_agent_finds_its_spares(tmp_path: Path, clock: StepClock) -> None:
    root = tmp_path / "node"
    before = ShardStore(root, budget_bytes=MiB, clock=clock)
    save(before, 1, b"\x01" * 64 * KiB, keep=3)
    spares = before.spares("job")
    assert len(spares) == 3
    again = ShardStore(root, budget_bytes=MiB, clock=clock)  # the agent restarted
    assert sorted(again.spares("job"), key=lambda s: s.buffer_id) == sorted(spares, key=lambda s: s.buffer_id)
    assert again.in_use_bytes == 4 * 64 * KiB
    assert save(again, 2, b"\x02" * 64 * KiB, keep=3) in {s.buffer_id for s in spares}
    assert again.prepare_spares("job", 0, files=4) == 0  # the rotation is whole already
    assert read(again, ShardKey("job", 0, 1)) == b"\x01" * 64 * KiB


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_an_agent_prepares_spares_after_a_save_and_keeps_retained_bytes(
    agent_plane: ControlPlane, tmp_path: Path
) -> None:
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "warm", 1))
    assert create_namespace(a, "job", 2, steps_retained=3).status_code == 201
    written: dict[int, bytes] = {}
    buffers = []
    for step in range(1, 9):
        data = os.urandom(256 * KiB)
        doc = httpx.post(f"{a}/v1/fast/reserve/job/0/{step}", params={"size": len(data)}).json()
        buffers.append(doc["buffer_id"])
        with open(doc["path"], "r+b") as handle:
            handle.write(data)
        answer = httpx.post(f"{a}/v1/fast/commit/{doc['token']}")
        assert answer.status_code == 200, answer.text
        written[step] = data
        if step == 1:
            # The rotation is ready once the first save is answered, and named to the trainer.
            assert metric(a, "hpsim_tier_spares") == 3
            assert metric(a, "hpsim_tier_spare_bytes") == 3 * len(data)
            assert len(answer.json()["spares"]) == 3
        for held in range(max(1, step - 2), step + 1):
            response = get(a, "job", 0, held)
            assert response.status_code == 200
            assert response.content == written[held]
    assert len(set(buffers)) == 4  # four files went round
    assert metric(a, "hpsim_tier_bytes_held") <= metric(a, "hpsim_tier_budget_bytes")


def test_a_spare_swapped_for_a_link_is_not_followed(tmp_path: Path, clock: StepClock) -> None:
    """A trainer of the agent's user can write the rank's directory: a spare replaced by a link
    to another file must not make the agent size or hand out that file."""
    store = ShardStore(tmp_path / "node", budget_bytes=MiB, clock=clock)
    save(store, 1, b"\x01" * 64 * KiB, keep=3)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    for spare in store.spares("job"):
        spare.path.unlink()
        spare.path.symlink_to(outside)
    reservation = store.reserve(ShardKey("job", 0, 2), 64 * KiB)
    assert not reservation.path.is_symlink()
    assert outside.read_bytes() == b"keep me"
    with reservation.buffer() as view:
        view[:] = b"\x02" * 64 * KiB
    reservation.commit(checksum=checksum_of(b"\x02" * 64 * KiB))
    assert read(store, ShardKey("job", 0, 2)) == b"\x02" * 64 * KiB
    assert outside.read_bytes() == b"keep me"
