"""The shard store of the in-memory tier (agents/store.py): files on tmpfs, budget, crash recovery."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest

from hyperpod_sim.agents.store import (
    BudgetExceeded,
    CorruptShard,
    ProtectFn,
    Reservation,
    ReservationCancelled,
    ShardInfo,
    ShardKey,
    ShardStore,
)
from hyperpod_sim.agents.store.files import KEY_NAME
from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.contracts.shm import UnsafeDirectory
from tests.clocks import StepClock
from tests.store import read

MiB = 1 << 20


class CountingProtect:
    def __init__(self, protected: AbstractSet[tuple[str, int]] = frozenset()) -> None:
        self.protected = protected
        self.calls = 0

    def __call__(self) -> AbstractSet[tuple[str, int]]:
        self.calls += 1
        return self.protected


def put(
    store: ShardStore,
    key: ShardKey,
    data: bytes,
    *,
    replica_of: str | None = None,
    protect: ProtectFn = frozenset,
) -> ShardInfo:
    reservation = store.reserve(key, len(data), protect=protect)
    with reservation.buffer() as view:
        view[:] = data
    return reservation.commit(checksum=checksum_of(data), replica_of=replica_of)


def files_under(root: Path) -> list[str]:
    """The store's files under ``root`` but its key (kept there when it has no key directory)."""
    return sorted(
        str(path.relative_to(root)) for path in root.rglob("*") if path.is_file() and path != root / KEY_NAME
    )


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


@pytest.fixture
def store(tmp_path: Path, clock: StepClock) -> ShardStore:
    return ShardStore(tmp_path / "node-a", budget_bytes=64 * MiB, clock=clock, key_dir=tmp_path / "state")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = Path("/dev/shm") / f"hpsim-test-{uuid.uuid4().hex}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------- round trip


def test_round_trip_stores_raw_bytes_in_one_file(store: ShardStore, clock: StepClock) -> None:
    key = ShardKey("job", 3, 100)
    data = os.urandom(3 * MiB + 17)

    info = put(store, key, data)

    assert info == store.get(key)
    assert (info.key, info.size, info.replica_of) == (key, len(data), None)
    assert info.checksum == checksum_of(data)
    assert info.committed_at == clock.now
    assert info.path.read_bytes() == data  # the fast path can mmap the file as it is
    assert read(store, key) == data
    assert store.in_use_bytes == len(data)
    assert store.shard_count == 1
    assert store.counters.bytes_written_total == len(data)


def test_checksum_is_base64_of_the_xxh3_128_digest() -> None:
    import base64

    import xxhash

    data = b"hello shard"
    assert checksum_of(data) == base64.b64encode(xxhash.xxh3_128(data).digest()).decode()
    assert checksum_of(memoryview(data)) == checksum_of(data)


def test_read_view_is_read_only_and_release_unmaps_it(store: ShardStore) -> None:
    info = put(store, ShardKey("job", 0, 1), b"x" * 8192)
    _, view = store.read_verified(info.key)
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 0
    if not os.path.exists("/proc/self/maps"):
        view.release()
        return
    assert str(info.path) in Path("/proc/self/maps").read_text()
    view.release()
    assert str(info.path) not in Path("/proc/self/maps").read_text()


def test_empty_shard(store: ShardStore) -> None:
    key = ShardKey("job", 0, 1)
    reservation = store.reserve(key, 0)
    assert len(reservation.buffer()) == 0
    info = reservation.commit(checksum=checksum_of(b""))
    assert info.size == 0
    assert read(store, key) == b""


def test_open_verified_gives_a_file_with_the_bytes(store: ShardStore) -> None:
    data = os.urandom(5000)
    put(store, ShardKey("job", 1, 2), data)
    info, handle = store.open_verified(ShardKey("job", 1, 2))
    with handle:
        assert handle.read() == data
    assert info.size == len(data)


def test_reading_a_shard_not_stored_is_a_key_error(store: ShardStore) -> None:
    with pytest.raises(KeyError):
        store.read_verified(ShardKey("job", 0, 1))
    assert store.get(ShardKey("job", 0, 1)) is None


def test_replacing_a_shard_keeps_an_earlier_reader_whole(store: ShardStore) -> None:
    key = ShardKey("job", 0, 7)
    old, new = os.urandom(10_000), os.urandom(20_000)
    put(store, key, old)
    _, old_view = store.read_verified(key)

    info = put(store, key, new, replica_of="node-b")

    assert bytes(old_view) == old  # the old file was renamed over, never written in place
    old_view.release()
    assert read(store, key) == new
    assert info.replica_of == "node-b"
    assert store.in_use_bytes == len(new)
    assert store.shard_count == 1


# ---------------------------------------------------------------------------------------- corruption


def test_checksum_mismatch_at_commit_stores_nothing(store: ShardStore) -> None:
    key = ShardKey("job", 0, 1)
    reservation = store.reserve(key, 4096)
    with reservation.buffer() as view:
        view[:] = b"a" * 4096
    assert store.in_use_bytes == 4096

    with pytest.raises(CorruptShard, match="rank 0 step 1 of namespace 'job'") as caught:
        reservation.commit(checksum=checksum_of(b"b" * 4096))

    assert caught.value.key == key
    assert store.get(key) is None
    assert store.in_use_bytes == 0
    assert store.counters.checksum_failures_total == 1
    assert files_under(store.root) == []
    reservation.abort()  # idempotent
    assert store.in_use_bytes == 0


def test_a_checksum_that_is_not_a_digest_stores_nothing(store: ShardStore) -> None:
    reservation = store.reserve(ShardKey("job", 0, 1), 10)
    with pytest.raises(ValueError, match="16"):
        reservation.commit(checksum="aGVsbG8=")
    assert store.in_use_bytes == 0
    assert files_under(store.root) == []


def test_copy_corrupted_on_disk_is_detected_counted_and_removed(store: ShardStore) -> None:
    key = ShardKey("job", 2, 5)
    info = put(store, key, os.urandom(MiB))
    with open(info.path, "r+b") as handle:
        handle.seek(MiB // 2)
        handle.write(b"\x00\xff")

    with pytest.raises(CorruptShard) as caught:
        store.read_verified(key)

    assert caught.value.key == key
    assert store.counters.checksum_failures_total == 1
    assert store.get(key) is None
    assert not info.path.exists()
    assert files_under(store.root) == []
    assert store.in_use_bytes == 0


def test_truncated_copy_is_corrupt(store: ShardStore) -> None:
    key = ShardKey("job", 0, 1)
    info = put(store, key, b"z" * 1000)
    os.truncate(info.path, 10)
    with pytest.raises(CorruptShard, match="10 bytes"):
        store.open_verified(key)
    assert store.get(key) is None


# ---------------------------------------------------------------------------------------- restart


def test_restart_rebuilds_the_index_and_drops_uncommitted_writes(tmp_path: Path, clock: StepClock) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    own = put(store, ShardKey("job", 0, 10), b"own shard")
    replica = put(store, ShardKey("job", 1, 10), b"replica shard", replica_of="node-b")
    odd = put(store, ShardKey("team/a run 1", 0, 3), b"odd namespace")
    crashed = store.reserve(ShardKey("job", 2, 10), 4096)  # the agent dies while this is written
    with crashed.buffer() as view:
        view[:] = b"q" * 4096
    assert any(name.endswith(".tmp") for name in files_under(root))

    again = ShardStore(root, budget_bytes=MiB, clock=clock)

    assert again.shards() == sorted([own, replica, odd], key=lambda info: info.key)
    assert again.get(ShardKey("job", 1, 10)) == replica  # replica_of and committed_at survive
    assert again.steps("job") == {10: {0, 1}}
    assert again.in_use_bytes == len(b"own shard") + len(b"replica shard") + len(b"odd namespace")
    assert not any(name.endswith(".tmp") for name in files_under(root))
    assert read(again, ShardKey("team/a run 1", 0, 3)) == b"odd namespace"


def test_shards_found_at_restart_keep_buffer_ids_of_their_own(tmp_path: Path, clock: StepClock) -> None:
    """A buffer id names one file: a trainer on the host keeps its mapping per buffer id and
    writes into it, and the agent commits that file. Shards found at restart, retired and reused
    for the next saves, must not share an id: a trainer would write step 5 into step 4's file while
    the agent commits step 2's old bytes as step 5, under a checksum of those bytes (the soak test,
    HPSIM_SOAK_SEED=291, restored "step 69" holding step 55's state)."""
    root = tmp_path / "node-a"
    before = ShardStore(root, budget_bytes=MiB, clock=clock)
    for step in (1, 2):
        put(before, ShardKey("job", 0, step), bytes([step]) * 100)
    store = ShardStore(root, budget_bytes=MiB, clock=clock)  # the agent restarted
    found = {step: store.local_path(ShardKey("job", 0, step)) for step in (1, 2)}
    assert all(f is not None and f[1] for f in found.values())
    ids = {step: f[1] for step, f in found.items() if f is not None}
    assert ids[1] != ids[2]

    handed_out = {}
    for step in (3, 4, 5):  # each save retires the oldest step; the next save reuses its file
        reservation = store.reserve(ShardKey("job", 0, step), 100)
        handed_out[step] = (reservation.buffer_id, os.stat(reservation.path).st_ino)
        with reservation.buffer() as view:
            view[:] = bytes([step]) * 100
        reservation.commit(checksum=checksum_of(bytes([step]) * 100))
        store.enforce_retention("job", 2)
    assert handed_out[4][0] == ids[1]
    assert handed_out[5][0] == ids[2]
    assert handed_out[4][1] != handed_out[5][1]  # two files, two ids
    assert read(store, ShardKey("job", 0, 5)) == bytes([5]) * 100


def test_crash_while_replacing_keeps_the_old_shard(
    tmp_path: Path, clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    key = ShardKey("job", 0, 1)
    old = put(store, key, b"old bytes")
    real_replace = os.replace

    def crash_before_data_rename(src: str | Path, dst: str | Path) -> None:
        if str(src).endswith(".shard.tmp"):
            raise KeyboardInterrupt("the agent dies here")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_before_data_rename)
    with pytest.raises(KeyboardInterrupt):
        put(store, key, b"new bytes, longer")
    monkeypatch.undo()

    again = ShardStore(root, budget_bytes=MiB, clock=clock)
    assert again.get(key) == old
    assert read(again, key) == b"old bytes"
    assert ShardStore(root, budget_bytes=MiB).get(key) == old  # the sidecar was rewritten for the old shard


def test_crash_before_the_first_data_rename_leaves_no_shard(
    tmp_path: Path, clock: StepClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    real_replace = os.replace

    def crash_before_data_rename(src: str | Path, dst: str | Path) -> None:
        if str(src).endswith(".shard.tmp"):
            raise KeyboardInterrupt("the agent dies here")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_before_data_rename)
    with pytest.raises(KeyboardInterrupt):
        put(store, ShardKey("job", 0, 1), b"never committed")
    monkeypatch.undo()

    again = ShardStore(root, budget_bytes=MiB, clock=clock)
    assert again.shards() == []
    assert files_under(root) == []


def test_restart_drops_shards_whose_files_do_not_agree(tmp_path: Path, clock: StepClock) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    torn_sidecar = put(store, ShardKey("job", 0, 1), b"one")
    no_sidecar = put(store, ShardKey("job", 0, 2), b"two")
    wrong_size = put(store, ShardKey("job", 0, 3), b"three")
    kept = put(store, ShardKey("job", 0, 4), b"four")
    torn_sidecar.path.with_suffix(".meta").write_text('{"version": 1, "curr')
    no_sidecar.path.with_suffix(".meta").unlink()
    with open(wrong_size.path, "ab") as handle:
        handle.write(b"!")

    again = ShardStore(root, budget_bytes=MiB, clock=clock)

    assert again.shards() == [kept]
    assert files_under(root) == ["job/0/4.meta", "job/0/4.shard"]


# ---------------------------------------------------------------------------------------- budget


def fill_steps(store: ShardStore, order: list[tuple[int, int]], *, size: int = 10) -> None:
    """Commit one ``size``-byte shard per (step, rank) of namespace "job", in this order."""
    for step, rank in order:
        put(store, ShardKey("job", rank, step), bytes([step]) * size)


def test_eviction_takes_whole_steps_oldest_first(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=60, clock=clock)
    # Step 2 has the oldest shard, but step 1's newest shard is older than step 2's newest.
    fill_steps(store, [(2, 0), (1, 0), (1, 1), (2, 1), (3, 0), (3, 1)])
    protect = CountingProtect()

    reservation = store.reserve(ShardKey("job", 0, 4), 10, protect=protect)

    assert store.steps("job") == {2: {0, 1}, 3: {0, 1}}
    assert store.counters.evictions_total == 2
    assert protect.calls == 1
    assert store.in_use_bytes == 50
    reservation.abort()

    put(store, ShardKey("job", 0, 4), b"4" * 30, protect=protect)  # 40 in use + 30 > 60: step 2 goes
    assert store.steps("job") == {3: {0, 1}, 4: {0}}


def test_eviction_never_takes_a_protected_step(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=40, clock=clock)
    fill_steps(store, [(1, 0), (1, 1), (2, 0), (2, 1)])

    put(store, ShardKey("job", 0, 3), b"3" * 20, protect=CountingProtect({("job", 1)}))

    assert store.steps("job") == {1: {0, 1}, 3: {0}}


def test_eviction_never_takes_the_incoming_shards_own_step(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=40, clock=clock)
    fill_steps(store, [(5, 0), (5, 1), (6, 0), (6, 1)])

    put(store, ShardKey("job", 2, 5), b"5" * 20)  # step 5 is older, but it is the shard's own

    assert store.steps("job") == {5: {0, 1, 2}}


def test_eviction_never_takes_a_step_being_written(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=50, clock=clock)
    fill_steps(store, [(1, 0), (2, 0), (3, 0)])
    writing = store.reserve(ShardKey("job", 1, 1), 10)  # rank 1 of step 1 is on its way

    put(store, ShardKey("job", 0, 4), b"4" * 20)

    assert store.steps("job") == {1: {0}, 3: {0}, 4: {0}}
    writing.abort()


def test_budget_exceeded_says_why_and_evicts_nothing(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=50, clock=clock)
    fill_steps(store, [(1, 0), (2, 0)], size=20)
    before = store.shards()

    with pytest.raises(BudgetExceeded) as caught:
        store.reserve(ShardKey("job", 0, 3), 40, protect=CountingProtect({("job", 2)}))

    assert (caught.value.needed, caught.value.budget, caught.value.in_use) == (40, 50, 40)
    assert "40 bytes" in str(caught.value)
    assert "50 bytes" in str(caught.value)
    assert store.shards() == before
    assert store.counters.evictions_total == 0
    assert store.in_use_bytes == 40


def test_protect_is_only_asked_when_something_must_go(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=50, clock=clock)
    protect = CountingProtect()
    put(store, ShardKey("job", 0, 1), b"1" * 20, protect=protect)
    with pytest.raises(BudgetExceeded, match="larger than the whole memory budget"):
        store.reserve(ShardKey("job", 0, 2), 51, protect=protect)
    assert protect.calls == 0


def test_a_zero_budget_means_tiering_is_off(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    protect = CountingProtect()
    with pytest.raises(BudgetExceeded, match="tiered storage is off") as caught:
        store.reserve(ShardKey("job", 0, 1), 1, protect=protect)
    assert (caught.value.needed, caught.value.budget, caught.value.in_use) == (1, 0, 0)
    assert protect.calls == 0


def test_concurrent_reservations_never_exceed_the_budget(tmp_path: Path) -> None:
    store = ShardStore(tmp_path, budget_bytes=100)
    threads_n = 16
    start = threading.Barrier(threads_n)
    granted: list[Reservation] = []
    refused: list[BudgetExceeded] = []
    guard = threading.Lock()

    def reserve(rank: int) -> None:
        start.wait()
        try:
            reservation = store.reserve(ShardKey("job", rank, rank), 10)
        except BudgetExceeded as exc:
            with guard:
                refused.append(exc)
        else:
            with guard:
                granted.append(reservation)

    threads = [threading.Thread(target=reserve, args=(rank,)) for rank in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(granted) == 10
    assert len(refused) == threads_n - 10
    assert store.in_use_bytes == 100
    for reservation in granted:
        reservation.abort()
    assert store.in_use_bytes == 0


def test_a_replacement_counts_both_copies_until_it_commits(store: ShardStore) -> None:
    key = ShardKey("job", 0, 1)
    put(store, key, b"a" * 100)
    reservation = store.reserve(key, 300)
    assert store.in_use_bytes == 400
    with reservation.buffer() as view:
        view[:] = b"b" * 300
    reservation.commit(checksum=checksum_of(b"b" * 300))
    assert store.in_use_bytes == 300


def test_set_budget_evicts_down_to_a_smaller_budget(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=100, clock=clock)
    fill_steps(store, [(1, 0), (2, 0), (3, 0)])
    protect = CountingProtect()

    assert store.set_budget(200, protect=protect) == []
    assert protect.calls == 0
    evicted = store.set_budget(15, protect=protect)

    assert evicted == [ShardKey("job", 0, 1), ShardKey("job", 0, 2)]
    assert store.steps("job") == {3: {0}}
    assert (store.budget_bytes, store.in_use_bytes) == (15, 10)
    assert store.counters.evictions_total == 2


def test_set_budget_keeps_protected_steps(tmp_path: Path, clock: StepClock) -> None:
    store = ShardStore(tmp_path, budget_bytes=100, clock=clock)
    fill_steps(store, [(1, 0), (2, 0), (3, 0)])
    evicted = store.set_budget(0, protect=lambda: {("job", 1)})
    assert evicted == [ShardKey("job", 0, 2), ShardKey("job", 0, 3)]
    assert store.steps("job") == {1: {0}}


# ---------------------------------------------------------------------------------------- retention, removal


def test_enforce_retention_keeps_the_newest_steps(store: ShardStore) -> None:
    for step in (5, 1, 4, 2, 3):
        for rank in (0, 1):
            put(store, ShardKey("job", rank, step), b"s")
    put(store, ShardKey("other", 0, 1), b"o")

    evicted = store.enforce_retention("job", 2, protect=lambda: {("job", 1)})

    assert evicted == [ShardKey("job", r, s) for r in (0, 1) for s in (2, 3)]
    assert store.steps("job") == {1: {0, 1}, 4: {0, 1}, 5: {0, 1}}
    assert store.steps("other") == {1: {0}}
    assert store.counters.evictions_total == 4
    assert store.enforce_retention("job", 3) == []


def test_delete_delete_namespace_and_clear(store: ShardStore) -> None:
    for namespace in ("a", "b/c"):
        for step in (1, 2):
            put(store, ShardKey(namespace, 0, step), b"data")

    assert store.delete(ShardKey("a", 0, 1)) is True
    assert store.delete(ShardKey("a", 0, 1)) is False
    assert store.delete_namespace("a") == 1
    assert store.delete_namespace("a") == 0
    assert [info.key.namespace for info in store.shards()] == ["b/c", "b/c"]
    assert store.shards("a") == []
    assert sorted(path.name for path in store.root.iterdir()) == ["b%2Fc"]

    store.clear()

    assert store.shards() == []
    assert store.in_use_bytes == 0
    assert list(store.root.iterdir()) == []
    assert store.counters.evictions_total == 0


def test_a_write_in_flight_does_not_survive_its_namespace(store: ShardStore) -> None:
    reservation = store.reserve(ShardKey("a", 0, 1), 3)
    with reservation.buffer() as view:
        view[:] = b"abc"
    store.delete_namespace("a")

    with pytest.raises(ReservationCancelled):
        reservation.commit(checksum=checksum_of(b"abc"))

    assert store.shards() == []
    assert store.in_use_bytes == 0
    assert files_under(store.root) == []


def test_a_reservation_ends_once(store: ShardStore) -> None:
    with store.reserve(ShardKey("a", 0, 1), 3) as reservation:
        pass  # leaving the block without commit aborts
    assert store.in_use_bytes == 0
    with pytest.raises(RuntimeError, match="aborted"):
        reservation.buffer()
    committed = store.reserve(ShardKey("a", 0, 2), 0)
    committed.commit(checksum=checksum_of(b""))
    committed.abort()  # no-op after commit
    assert store.get(ShardKey("a", 0, 2)) is not None


# ---------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("namespace", ["team/run 1", "..", ".", "a.b", "x%2Fy", "naïve 日本", " "])
def test_any_namespace_name_is_one_directory(tmp_path: Path, namespace: str) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB)
    info = put(store, ShardKey(namespace, 1, 2), b"payload", replica_of="node-z")

    assert info.path.parent.parent.parent == root
    again = ShardStore(root, budget_bytes=MiB)
    assert again.shards(namespace) == [info]
    assert read(again, info.key) == b"payload"


def test_unusable_keys_are_refused(store: ShardStore) -> None:
    with pytest.raises(ValueError, match="empty"):
        store.reserve(ShardKey("", 0, 1), 1)
    with pytest.raises(ValueError, match="negative"):
        store.reserve(ShardKey("job", -1, 1), 1)
    with pytest.raises(ValueError, match="too long"):
        store.reserve(ShardKey("/" * 100, 0, 1), 1)


# ---------------------------------------------------------------------------------------- on tmpfs


def test_on_dev_shm_shards_survive_a_new_store(shm_root: Path) -> None:
    store = ShardStore(shm_root, budget_bytes=64 * MiB)
    data = os.urandom(8 * MiB)
    put(store, ShardKey("job", 0, 1), data, replica_of="node-b")
    crashed = store.reserve(ShardKey("job", 1, 1), MiB)

    again = ShardStore(shm_root, budget_bytes=64 * MiB)

    assert read(again, ShardKey("job", 0, 1)) == data
    assert again.get(ShardKey("job", 0, 1)) == store.get(ShardKey("job", 0, 1))
    assert again.in_use_bytes == len(data)
    crashed.abort()


# ---------------------------------------------------------------------------------------- a shared host
# Issue 23, finding 3: another local user who could write the store's directory planted a shard
# with a matching sidecar, and the next agent adopted and served it.

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def forged_sidecar(data_path: Path, data: bytes) -> str:
    """A sidecar as the store wrote one before it sealed them: all it took to be adopted."""
    inode, size = data_path.stat().st_ino, len(data)
    record = {
        "size": size,
        "checksum": checksum_of(data),
        "replica_of": None,
        "committed_at": 5e9,
        "inode": inode,
    }
    return json.dumps({"version": 1, "current": record, "previous": None})


def test_a_planted_shard_and_sidecar_are_not_adopted(tmp_path: Path, clock: StepClock) -> None:
    root, state = tmp_path / "node-a", tmp_path / "state"
    store = ShardStore(root, budget_bytes=MiB, clock=clock, key_dir=state)
    own = put(store, ShardKey("job", 0, 1), b"the agent's own")
    forged = b"someone else's bytes"
    planted = root / "job" / "0" / "999.shard"
    planted.write_bytes(forged)
    planted.with_suffix(".meta").write_text(forged_sidecar(planted, forged))

    again = ShardStore(root, budget_bytes=MiB, clock=clock, key_dir=state)

    assert again.shards() == [own]
    assert again.steps("job") == {1: {0}}
    assert files_under(root) == ["job/0/1.meta", "job/0/1.shard"]


def test_a_sealed_sidecar_does_not_vouch_for_another_step(tmp_path: Path, clock: StepClock) -> None:
    """A sealed shard and sidecar renamed to a newer step (same inode, same size) are not that step."""
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    info = put(store, ShardKey("job", 0, 1), b"step one")
    info.path.rename(info.path.with_name("999.shard"))
    info.path.with_suffix(".meta").rename(info.path.with_name("999.meta"))

    again = ShardStore(root, budget_bytes=MiB, clock=clock)

    assert again.shards() == []
    assert files_under(root) == []


def test_another_key_does_not_adopt_the_shards(tmp_path: Path, clock: StepClock) -> None:
    """Shards sealed with another store's key (another data dir) are not this store's."""
    root = tmp_path / "node-a"
    put(
        ShardStore(root, budget_bytes=MiB, clock=clock, key_dir=tmp_path / "one"), ShardKey("job", 0, 1), b"x"
    )
    again = ShardStore(root, budget_bytes=MiB, clock=clock, key_dir=tmp_path / "two")
    assert again.shards() == []


def test_restart_checks_the_bytes_not_only_the_sidecar(tmp_path: Path, clock: StepClock) -> None:
    """Bytes changed in place (same inode, same size) while the agent was down: not adopted."""
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB, clock=clock)
    kept = put(store, ShardKey("job", 0, 1), b"unchanged")
    changed = put(store, ShardKey("job", 0, 2), b"original")
    with open(changed.path, "r+b") as handle:
        handle.write(b"ORIGINAL")

    again = ShardStore(root, budget_bytes=MiB, clock=clock)

    assert again.shards() == [kept]
    assert files_under(root) == ["job/0/1.meta", "job/0/1.shard"]


@needs_root
@pytest.mark.parametrize("where", ["root", "namespace", "rank"])
def test_a_directory_of_another_user_is_refused(tmp_path: Path, where: str) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB)
    put(store, ShardKey("job", 0, 1), b"x")
    target = {"root": root, "namespace": root / "job", "rank": root / "job" / "0"}[where]
    os.chown(target, NOBODY, NOBODY)

    with pytest.raises(UnsafeDirectory) as caught:
        ShardStore(root, budget_bytes=MiB)

    assert caught.value.path == target
    assert str(caught.value) == (
        f"{target} belongs to uid {NOBODY}, not to this process's user (uid 0): another local user made "
        "it and could rename or replace what is in it"
    )


@pytest.mark.parametrize("where", ["root", "namespace", "rank"])
def test_a_directory_others_may_write_is_refused(tmp_path: Path, where: str) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB)
    put(store, ShardKey("job", 0, 1), b"x")
    target = {"root": root, "namespace": root / "job", "rank": root / "job" / "0"}[where]
    os.chmod(target, 0o777)

    with pytest.raises(UnsafeDirectory, match=r"has mode 0777: other users may write into it") as caught:
        ShardStore(root, budget_bytes=MiB)
    assert caught.value.path == target


def test_a_parent_others_may_rename_in_is_refused(tmp_path: Path) -> None:
    """The squatted /dev/shm/hpsim: a node's directory under a directory every user may write
    (without the sticky bit of /dev/shm itself) could be renamed away by any of them."""
    shared = tmp_path / "hpsim"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(
        UnsafeDirectory, match=r"has mode 0777: other users may rename what is in it"
    ) as caught:
        ShardStore(shared / "node-a", budget_bytes=MiB)
    assert caught.value.path == shared
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /dev/shm: others may not rename what they do not own
    assert ShardStore(sticky / "node-a", budget_bytes=MiB).shards() == []


def test_the_root_and_the_key_dir_are_made_owner_only(tmp_path: Path) -> None:
    ShardStore(tmp_path / "a" / "node-a", budget_bytes=MiB, key_dir=tmp_path / "state")
    for path in (tmp_path / "a", tmp_path / "a" / "node-a", tmp_path / "state"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE((tmp_path / "state" / KEY_NAME).stat().st_mode) == 0o600


def test_after_its_root_is_replaced_the_store_writes_nothing_into_the_new_one(tmp_path: Path) -> None:
    root = tmp_path / "node-a"
    store = ShardStore(root, budget_bytes=MiB)
    put(store, ShardKey("job", 0, 1), b"x")
    root.rename(tmp_path / "moved")
    root.mkdir(mode=0o700)

    with pytest.raises(OSError, match="is not the one this agent started with"):
        store.reserve(ShardKey("job", 0, 2), 10)

    assert list(root.iterdir()) == []
    with pytest.raises(CorruptShard):  # its file is not where it was
        store.read_verified(ShardKey("job", 0, 1))


def test_a_shards_save_survives_a_restart_and_other_saves_of_its_step_are_dropped(
    tmp_path: Path, clock: StepClock
) -> None:
    root, keys = tmp_path / "node-a", tmp_path / "state"
    store = ShardStore(root, budget_bytes=64 * MiB, clock=clock, key_dir=keys)
    old, new, other_step = ShardKey("job", 0, 5), ShardKey("job", 1, 5), ShardKey("job", 0, 4)
    for key, save in ((old, "one"), (new, "two"), (other_step, "one")):
        reservation = store.reserve(key, 3)
        with reservation.buffer() as view:
            view[:] = b"abc"
        assert reservation.commit(checksum=checksum_of(b"abc"), save=save).save == save
    # The save is sealed into the sidecar: a restarted store adopts the shards with it.
    restarted = ShardStore(root, budget_bytes=64 * MiB, clock=clock, key_dir=keys)
    assert {info.key: info.save for info in restarted.shards()} == {old: "one", new: "two", other_step: "one"}
    # Save two of step 5 is committed: save one's shards of step 5 go, other steps stay.
    assert restarted.drop_other_saves("job", 5, "two") == [old]
    assert [info.key for info in restarted.shards()] == [other_step, new]
    assert not (root / "job" / "0" / "5.shard").exists()
