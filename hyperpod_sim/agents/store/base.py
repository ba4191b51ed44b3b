"""The state a shard store holds, under its lock, and the paths it writes to: the base of
:class:`agents.store.ShardStore`, whose parts (spares, recovery) each build on it."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hyperpod_sim.agents.store.files import (
    DATA_SUFFIX,
    META_SUFFIX,
    Record,
    Seal,
    make_private_dirs,
    prune_empty_dirs,
)
from hyperpod_sim.agents.store.keys import ShardInfo, ShardKey, StoreCounters, encode_namespace

if TYPE_CHECKING:
    from hyperpod_sim.agents.store.reservation import Reservation


@dataclass(frozen=True)
class SpareInfo:
    """A file kept (and counted in the budget) for the next reservation of its namespace and rank:
    a retired shard's or one prepared in advance, already allocated and faulted in."""

    namespace: str
    rank: int
    path: Path
    size: int
    buffer_id: str


@dataclass
class Preparing:
    """A spare being made (outside the lock): its bytes count in the budget until it is a spare,
    or until a reservation that needs the room cancels it."""

    namespace: str
    rank: int
    size: int
    cancelled: bool = False


@dataclass(frozen=True)
class Entry:
    """An index entry: a committed shard, the inode of its data file and the buffer id that names
    that file (unique per file: trainers keep their mappings by it)."""

    info: ShardInfo
    inode: int
    buffer_id: str

    @property
    def record(self) -> Record:
        info = self.info
        return Record(info.size, info.checksum, info.replica_of, info.committed_at, self.inode, info.save)


class StoreState:
    """What every part of the store reads and changes, always under ``_lock`` (``ShardStore.__init__``
    sets it all), and the paths of a shard."""

    _root: Path
    _real_root: Path  # the root as it resolved at start: what every shard directory must be under
    _root_id: tuple[int, int]  # (device, inode) of the root at start: a root renamed away is not it
    _seal: Seal  # seals the sidecars this store writes; only sealed ones are adopted at startup
    _budget: int
    _clock: Callable[[], float]
    _lock: threading.Lock
    _index: dict[ShardKey, Entry]
    _committed_bytes: int
    _reserved_bytes: int
    _reservations: set[Reservation]
    # Files kept for the next reservations of their (namespace, rank), oldest first: retired
    # primary shards and files prepared in advance (``prepare_spares``).
    _spares: dict[tuple[str, int], list[SpareInfo]]
    _spare_bytes: int
    _preparing: list[Preparing]
    _preparing_bytes: int
    # (namespace, rank) -> the size of its last primary reservation: what spares are made for.
    _rank_sizes: dict[tuple[str, int], int]
    # (namespace, rank)s whose trainer reserves its next write ahead: their rotation holds one
    # file more (that write), so a spare stays free for a trainer that starts over meanwhile.
    _ahead_ranks: set[tuple[str, int]]
    # inode -> readers in this process (replication, S3 uploads, responses): not recycled.
    _pins: dict[int, int]
    _counters: StoreCounters
    # Called with a namespace whenever a shard of it comes or goes (under the lock, from any thread).
    _watchers: list[Callable[[str], None]]

    def _touched(self, namespace: str) -> None:
        for watcher in self._watchers:
            watcher(namespace)

    def _in_use_locked(self) -> int:
        return self._committed_bytes + self._reserved_bytes + self._spare_bytes + self._preparing_bytes

    def _remove_locked(self, key: ShardKey) -> bool:
        """Drop a shard from the index and the disk (data first, then its sidecar)."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._touched(key.namespace)
        self._committed_bytes -= entry.info.size
        entry.info.path.unlink(missing_ok=True)
        entry.info.path.with_suffix(META_SUFFIX).unlink(missing_ok=True)
        prune_empty_dirs(entry.info.path.parent, stop=self._root)
        return True

    def _shard_dir(self, key: ShardKey) -> Path:
        return self._root / encode_namespace(key.namespace) / str(key.rank)

    def _ready_shard_dir(self, key: ShardKey) -> Path:
        """The shard's directory, made if missing. A link put in place of the namespace's or the
        rank's directory is removed first: the store writes under its root only."""
        self._check_root()
        directory = self._shard_dir(key)
        make_private_dirs(directory)
        if Path(os.path.realpath(directory)) != self._real_shard_dir(key):
            for path in (directory.parent, directory):
                if path.is_symlink():
                    path.unlink()
            make_private_dirs(directory)
            if Path(os.path.realpath(directory)) != self._real_shard_dir(key):
                raise OSError(f"{directory} does not resolve to a directory under the store's root")
        return directory

    def _check_root(self) -> None:
        """OSError unless the root is still the directory the store started with: one renamed
        away and replaced (by whoever could) is not written into."""
        info = os.lstat(self._real_root)
        if (info.st_dev, info.st_ino) != self._root_id:
            raise OSError(
                f"the shared-memory directory {self._root} is not the one this agent started with "
                "(it was renamed or replaced): nothing is written into it; restart the agent"
            )

    def _real_shard_dir(self, key: ShardKey) -> Path:
        """Where ``_shard_dir(key)`` must resolve to: under the root as it resolved at start."""
        return self._real_root / encode_namespace(key.namespace) / str(key.rank)

    def _data_path(self, key: ShardKey) -> Path:
        return self._shard_dir(key) / f"{key.step}{DATA_SUFFIX}"
