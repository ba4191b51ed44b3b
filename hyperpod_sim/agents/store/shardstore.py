"""The shard store itself: the budget, reservations and commits, reads, removal and retention (see
:mod:`agents.store`)."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import replace
from io import BufferedReader
from pathlib import Path
from stat import S_ISREG

from hyperpod_sim.agents.store.base import Entry, SpareInfo
from hyperpod_sim.agents.store.files import (
    DATA_SUFFIX,
    FILE_MODE,
    META_SUFFIX,
    Record,
    Seal,
    load_key,
    prune_empty_dirs,
    temp_name,
    write_sidecar,
)
from hyperpod_sim.agents.store.keys import (
    BudgetExceeded,
    CorruptShard,
    ProtectFn,
    ReservationCancelled,
    ShardInfo,
    ShardKey,
    StepId,
    StoreCounters,
    check_key,
    nothing_protected,
)
from hyperpod_sim.agents.store.recovery import StoreRecovery
from hyperpod_sim.agents.store.reservation import Reservation, ReservationState
from hyperpod_sim.agents.store.spares import SpareRotation
from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.contracts.shm import private_directory


class ShardStore(SpareRotation, StoreRecovery):
    """Shards in files under ``root``, indexed in memory, within a memory budget (0: tiering off)."""

    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int = 0,
        clock: Callable[[], float] = time.time,
        key_dir: Path | None = None,
    ) -> None:
        """Create ``root`` if needed and rebuild the index from it (see :mod:`agents.store`).

        ``root`` must be this user's only (contracts/shm.py: UnsafeDirectory otherwise, naming
        the path and the problem). ``key_dir``: the private directory that keeps the key sealing
        the sidecars (the agent's data dir), else ``root`` itself. Only shards whose sidecar that
        key sealed, and whose bytes match it, are adopted. Shards found are kept even beyond
        ``budget_bytes``; the next ``set_budget`` evicts down.
        """
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative (got {budget_bytes})")
        self._root = Path(root)
        self._budget = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._index = {}
        self._committed_bytes = 0
        self._reserved_bytes = 0
        self._reservations = set()
        self._spares = {}
        self._spare_bytes = 0
        self._preparing = []
        self._preparing_bytes = 0
        self._rank_sizes = {}
        self._ahead_ranks = set()
        self._pins = {}
        self._counters = StoreCounters()
        self._watchers = []
        self._real_root = private_directory(self._root)
        info = os.lstat(self._real_root)
        self._root_id = (info.st_dev, info.st_ino)
        self._seal = Seal(load_key(self._real_root if key_dir is None else private_directory(key_dir)))
        self._recover()

    def watch(self, watcher: Callable[[str], None]) -> None:
        """Call ``watcher(namespace)`` whenever a shard of the namespace is committed or removed
        (eviction, retention, deletes included). It runs under the store's lock, in whatever
        thread changed the store: it must only hand the news on (``call_soon_threadsafe``)."""
        self._watchers.append(watcher)

    # -- properties

    @property
    def root(self) -> Path:
        return self._root

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def in_use_bytes(self) -> int:
        """Committed shards plus reservations in flight."""
        with self._lock:
            return self._in_use_locked()

    @property
    def shard_count(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def counters(self) -> StoreCounters:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._counters)

    # -- budget

    def set_budget(self, budget_bytes: int, *, protect: ProtectFn = nothing_protected) -> list[ShardKey]:
        """Set the budget; a smaller one evicts down to it, oldest step first; returns what was evicted.

        Protected steps and steps being written are kept even if the budget cannot be reached
        without them; the other evictions still happen (the budget is in force either way).
        """
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative (got {budget_bytes})")
        with self._lock:
            self._budget = budget_bytes
            self._free_spares_locked(0)
            if self._in_use_locked() <= budget_bytes:
                return []
        protected = frozenset(protect())
        with self._lock:
            excess = self._in_use_locked() - self._budget
            if excess <= 0:
                return []
            plan, _ = self._plan_locked(excess=excess, exclude=protected)
            return self._evict_locked(plan)

    def reserve(
        self, key: ShardKey, size: int, *, protect: ProtectFn = nothing_protected, ahead: bool = False
    ) -> Reservation:
        """Room for ``size`` bytes of ``key`` and a file to write them into (see ``Reservation``).
        ``ahead``: the rank's next write, reserved before its step is known (``Reservation.rebind``
        names it); the rank's rotation then holds one file more (``prepare_spares``).

        If the budget is short, evicts whole steps, oldest first, never a step in ``protect()``
        (called only then), ``key``'s own step or a step being written; raises BudgetExceeded,
        evicting nothing, when that cannot make the shard fit or the budget is 0 (tiering off).
        Raises OSError if the memory cannot be allocated (tmpfs full).
        """
        check_key(key)
        if size < 0:
            raise ValueError(f"size must not be negative (got {size})")
        reservation, fd = self._reserve_locked_or_evict(key, size, protect)
        try:
            reservation._prepare(fd)
        except BaseException:
            reservation.abort()
            raise
        if ahead:
            with self._lock:
                reservation._ahead = True
                self._ahead_ranks.add((key.namespace, key.rank))
        return reservation

    def _reserve_locked_or_evict(
        self, key: ShardKey, size: int, protect: ProtectFn
    ) -> tuple[Reservation, int]:
        with self._lock:
            self._check_can_ever_fit(size)
            spare = self._take_spare_locked(key, size)
            self._free_spares_locked(size)
            if self._in_use_locked() + size <= self._budget:
                return self._open_locked(key, size, spare)
        protected = frozenset(protect())
        with self._lock:
            self._check_can_ever_fit(size)
            self._free_spares_locked(size)
            in_use = self._in_use_locked()
            excess = in_use + size - self._budget
            if excess > 0:
                plan, freed = self._plan_locked(
                    excess=excess, exclude=protected | {(key.namespace, key.step)}
                )
                if freed < excess:
                    if spare is not None:
                        spare.path.unlink(missing_ok=True)
                    raise BudgetExceeded(
                        needed=size,
                        budget=self._budget,
                        in_use=in_use,
                        message=(
                            f"cannot store {size} bytes: the memory budget is {self._budget} bytes, {in_use} "
                            f"bytes are in use, and evicting every step that is not protected, being written "
                            f"or the shard's own would free only {freed} bytes; nothing was evicted"
                        ),
                    )
                self._evict_locked(plan)
            return self._open_locked(key, size, spare)

    def _check_can_ever_fit(self, size: int) -> None:
        in_use = self._in_use_locked()
        if self._budget == 0:
            raise BudgetExceeded(
                needed=size,
                budget=0,
                in_use=in_use,
                message=f"tiered storage is off (memory budget 0 bytes): cannot store {size} bytes "
                f"({in_use} bytes in use)",
            )
        if size > self._budget:
            raise BudgetExceeded(
                needed=size,
                budget=self._budget,
                in_use=in_use,
                message=f"a shard of {size} bytes is larger than the whole memory budget of {self._budget} "
                f"bytes ({in_use} bytes in use)",
            )

    def _plan_locked(self, *, excess: int, exclude: AbstractSet[StepId]) -> tuple[list[StepId], int]:
        """Steps to evict, oldest first, until ``excess`` bytes are freed (or none are left); bytes freed."""
        busy = {(r.key.namespace, r.key.step) for r in self._reservations}
        newest: dict[StepId, float] = {}
        sizes: dict[StepId, int] = {}
        for key, entry in self._index.items():
            step = (key.namespace, key.step)
            newest[step] = max(newest.get(step, entry.info.committed_at), entry.info.committed_at)
            sizes[step] = sizes.get(step, 0) + entry.info.size
        plan: list[StepId] = []
        freed = 0
        for step in sorted(newest, key=lambda s: (newest[s], s)):
            if freed >= excess:
                break
            if step in exclude or step in busy or sizes[step] == 0:
                continue
            plan.append(step)
            freed += sizes[step]
        return plan, freed

    def _evict_locked(self, steps: Iterable[StepId], *, recycle_files: int = 0) -> list[ShardKey]:
        """Remove whole steps; with ``recycle_files``, keep their primary files as spares (up to
        that many files per rank)."""
        doomed = set(steps)
        keys = sorted(key for key in self._index if (key.namespace, key.step) in doomed)
        for key in keys:
            if not (recycle_files and self._retire_locked(key, files=recycle_files)):
                self._remove_locked(key)
        self._counters.evictions_total += len(keys)
        return keys

    # -- writing

    def _open_locked(self, key: ShardKey, size: int, spare: SpareInfo | None) -> tuple[Reservation, int]:
        """A new reservation and the fd of its temporary file (a spare's, else a new empty one);
        counted in in_use at once."""
        directory = self._ready_shard_dir(key)
        temp = directory / temp_name(key.step, DATA_SUFFIX)
        fd = -1
        if spare is not None:
            try:
                os.replace(spare.path, temp)
                # A spare lies in a directory its trainers can write: what is there now is used
                # only if it is still a plain file of one name (not a link, FIFO or alias).
                fd = os.open(temp, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
                stat = os.fstat(fd)
                if not S_ISREG(stat.st_mode) or stat.st_nlink != 1:
                    os.close(fd)
                    fd = -1
                    raise OSError(errno.EINVAL, "not a plain file")
            except OSError:
                spare.path.unlink(missing_ok=True)
                temp.unlink(missing_ok=True)
                spare = None
        if fd < 0:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        buffer_id = spare.buffer_id if spare is not None else uuid.uuid4().hex
        reservation = Reservation(store=self, key=key, size=size, temp_path=temp, buffer_id=buffer_id)
        self._reservations.add(reservation)
        self._reserved_bytes += size
        return reservation, fd

    def _publish(
        self, reservation: Reservation, *, checksum: str, replica_of: str | None, save: str | None = None
    ) -> ShardInfo:
        """Commit steps 2 and 3 (module docstring), then the index."""
        key = reservation.key
        with self._lock:
            reservation._require_open()
            if reservation._cancelled:
                raise ReservationCancelled(key)
            old = self._index.get(key)
            data_path = self._data_path(key)
            record = Record(reservation.size, checksum, replica_of, self._clock(), reservation._inode, save)
            write_sidecar(
                data_path.with_suffix(META_SUFFIX),
                current=record,
                previous=None if old is None else old.record,
                seal=self._seal,
            )
            os.replace(reservation._temp_path, data_path)
            self._end_reservation_locked(reservation, state="committed")
            if old is not None:
                self._committed_bytes -= old.info.size
            entry = Entry(
                ShardInfo(key, record.size, checksum, replica_of, data_path, record.committed_at, save),
                record.inode,
                reservation.buffer_id,
            )
            self._index[key] = entry
            self._touched(key.namespace)
            self._committed_bytes += record.size
            self._counters.bytes_written_total += record.size
            if replica_of is None:
                self._rank_sizes[(key.namespace, key.rank)] = reservation._reserved_size
            return entry.info

    def _release(self, reservation: Reservation, *, spare_files: int | None = None) -> None:
        with self._lock:
            if reservation._state != "open":
                return
            self._end_reservation_locked(reservation, state="aborted")
            keep = spare_files is not None and not reservation._cancelled  # not for a namespace gone
            if keep and self._keep_as_spare_locked(reservation, files=spare_files or 0):
                return
            reservation._temp_path.unlink(missing_ok=True)
            prune_empty_dirs(reservation._temp_path.parent, stop=self._root)

    def _end_reservation_locked(self, reservation: Reservation, *, state: ReservationState) -> None:
        reservation._state = state
        reservation._release_mapping()
        self._reservations.discard(reservation)
        self._reserved_bytes -= reservation.size

    def _rebind(self, reservation: Reservation, key: ShardKey) -> None:
        check_key(key)
        with self._lock:
            reservation._require_open()
            if reservation._cancelled:
                raise ReservationCancelled(reservation.key)
            reservation._key = key

    def _shrink(self, reservation: Reservation, size: int) -> None:
        with self._lock:
            self._reserved_bytes -= reservation._size - size
            reservation._size = size

    def _count_checksum_failure(self) -> None:
        with self._lock:
            self._counters.checksum_failures_total += 1

    # -- reading

    def get(self, key: ShardKey) -> ShardInfo | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.info

    def pin(self, key: ShardKey) -> Callable[[], None]:
        """Keep the file of ``key``'s current shard from being reused for a later shard while
        this process reads it (it may still be deleted; an open file or mapping keeps its
        bytes). Returns the unpin function (idempotent)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return lambda: None
            inode = entry.inode
            self._pins[inode] = self._pins.get(inode, 0) + 1
        done = False

        def unpin() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                left = self._pins.get(inode, 1) - 1
                if left:
                    self._pins[inode] = left
                else:
                    self._pins.pop(inode, None)

        return unpin

    def local_path(self, key: ShardKey) -> tuple[ShardInfo, str] | None:
        """The shard's info and buffer id, for a reader on this host that maps the file itself
        (and checks the checksum itself: the file may be retired meanwhile)."""
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else (entry.info, entry.buffer_id)

    def read_verified(self, key: ShardKey) -> tuple[ShardInfo, memoryview]:
        """The shard's info and a read-only view of its file, once its checksum has been verified.

        The view maps the file; release it with ``view.release()`` (or ``with view:``), which unmaps
        it at once (otherwise it is unmapped when the view is garbage-collected). Hashing runs
        outside the lock: call this from a worker thread for big shards. KeyError if the shard is
        not stored; CorruptShard if the copy fails its checksum, in which case it is counted and
        removed from the index and the disk.
        """
        entry, fd = self._open_entry(key)
        try:
            mapping = self._verified_mapping(entry, fd)
        finally:
            os.close(fd)
        return entry.info, memoryview(mapping) if mapping is not None else memoryview(b"")

    def open_verified(self, key: ShardKey) -> tuple[ShardInfo, BufferedReader]:
        """Like ``read_verified``, but a file opened for reading (e.g. for sendfile); the caller closes it."""
        entry, fd = self._open_entry(key)
        try:
            mapping = self._verified_mapping(entry, fd)
            if mapping is not None:
                mapping.close()
            return entry.info, open(fd, "rb")  # the caller closes it
        except BaseException:
            os.close(fd)
            raise

    def _open_entry(self, key: ShardKey) -> tuple[Entry, int]:
        """The index entry and an fd of its file, opened under the lock so that they agree."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                raise KeyError(key)
            try:
                return entry, os.open(entry.info.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as exc:  # gone, or a link put in its place (ELOOP)
                self._counters.checksum_failures_total += 1
                self._remove_locked(key)
                problem = exc.strerror
        raise CorruptShard(key, detail=f"its file cannot be opened ({problem}); the copy was dropped")

    def _verified_mapping(self, entry: Entry, fd: int) -> mmap.mmap | None:
        """A read-only mapping of ``fd`` (None for an empty shard) whose bytes match the checksum."""
        info = entry.info
        stat = os.fstat(fd)
        size = stat.st_size
        if not S_ISREG(stat.st_mode) or stat.st_ino != entry.inode:
            problem = "its file was replaced by another one"
        elif size != info.size:
            problem = f"its file holds {size} bytes, not {info.size}"
        else:
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
            actual = checksum_of(mapping if mapping is not None else b"")
            if actual == info.checksum:
                return mapping
            if mapping is not None:
                mapping.close()
            problem = f"its bytes hash to {actual}, not {info.checksum}"
        with self._lock:
            self._counters.checksum_failures_total += 1
            if self._index.get(info.key) is entry:
                self._remove_locked(info.key)
        raise CorruptShard(info.key, detail=f"{problem}; the copy was dropped")

    def shards(self, namespace: str | None = None) -> list[ShardInfo]:
        """Committed shards (of one namespace, or all), ordered by key."""
        with self._lock:
            return [
                entry.info
                for key, entry in sorted(self._index.items())
                if namespace is None or key.namespace == namespace
            ]

    def steps(self, namespace: str) -> dict[int, set[int]]:
        """step -> ranks held here (primary or replica) for one namespace."""
        held: dict[int, set[int]] = {}
        with self._lock:
            for key in self._index:
                if key.namespace == namespace:
                    held.setdefault(key.step, set()).add(key.rank)
        return held

    # -- removing

    def delete(self, key: ShardKey) -> bool:
        """Remove one shard; False if it was not stored."""
        with self._lock:
            return self._remove_locked(key)

    def drop_other_saves(self, namespace: str, step: int, save: str) -> list[ShardKey]:
        """Remove every shard of ``step`` of ``namespace`` held here (primary or replica) that is
        not of save ``save`` (another save's, or one sent without a save): the step's metadata of
        that save is committed, so it replaces the earlier saves whole. The shards removed."""
        with self._lock:
            doomed = [
                key
                for key, entry in self._index.items()
                if key.namespace == namespace and key.step == step and entry.info.save != save
            ]
            for key in doomed:
                self._remove_locked(key)
            return sorted(doomed)

    def delete_namespace(self, namespace: str) -> int:
        """Remove every shard of a namespace; writes in flight to it will fail to commit. Shards removed."""
        with self._lock:
            keys = [key for key in self._index if key.namespace == namespace]
            for key in keys:
                self._remove_locked(key)
            for reservation in self._reservations:
                if reservation.key.namespace == namespace:
                    reservation._cancelled = True
            self._drop_spares_locked(namespace)
            return len(keys)

    def clear(self) -> None:
        """Remove every shard (cluster reset, node loss); writes in flight will fail to commit."""
        with self._lock:
            for key in list(self._index):
                self._remove_locked(key)
            for reservation in self._reservations:
                reservation._cancelled = True
            self._drop_spares_locked()

    def enforce_retention(
        self, namespace: str, keep_steps: int, *, protect: ProtectFn = nothing_protected
    ) -> list[ShardKey]:
        """Keep the newest ``keep_steps`` steps (by number) of a namespace; evict older ones not protected.

        Steps being written are kept too. Counts as evictions; returns the shards removed.
        """
        if keep_steps < 0:
            raise ValueError(f"keep_steps must not be negative (got {keep_steps})")
        with self._lock:
            if not self._older_steps_locked(namespace, keep_steps):
                return []
        protected = frozenset(protect())
        with self._lock:
            busy = {(r.key.namespace, r.key.step) for r in self._reservations}
            doomed = [
                (namespace, step)
                for step in self._older_steps_locked(namespace, keep_steps)
                if (namespace, step) not in protected and (namespace, step) not in busy
            ]
            return self._evict_locked(doomed, recycle_files=keep_steps + 1)

    def _older_steps_locked(self, namespace: str, keep_steps: int) -> list[int]:
        steps = sorted({key.step for key in self._index if key.namespace == namespace}, reverse=True)
        return steps[keep_steps:]
