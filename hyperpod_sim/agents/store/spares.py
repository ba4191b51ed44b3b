"""The spares of a shard store: files kept (and counted in the budget) for the next reservations of
their namespace and rank, retired shards or made in advance (see :mod:`agents.store`, "Spares")."""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from pathlib import Path
from stat import S_ISREG
from typing import TYPE_CHECKING

from hyperpod_sim.agents.store.base import Preparing, SpareInfo, StoreState
from hyperpod_sim.agents.store.files import (
    FILE_MODE,
    META_SUFFIX,
    TEMP_SUFFIX,
    prefault,
    prune_empty_dirs,
    spare_name,
)
from hyperpod_sim.agents.store.keys import ShardKey

if TYPE_CHECKING:
    from hyperpod_sim.agents.store.reservation import Reservation


class SpareRotation(StoreState):
    """The store's spares: taken by a reservation, dropped for room, made by ``prepare_spares``."""

    def spares(self, namespace: str | None = None) -> list[SpareInfo]:
        """The spare files held (of one namespace, or all), by namespace and rank, oldest first."""
        with self._lock:
            return [
                spare
                for where in sorted(self._spares)
                for spare in self._spares[where]
                if namespace is None or where[0] == namespace
            ]

    @property
    def spare_bytes(self) -> int:
        """Bytes of spare files (counted in ``in_use_bytes``), those being prepared included."""
        with self._lock:
            return self._spare_bytes + self._preparing_bytes

    def _take_spare_locked(self, key: ShardKey, size: int) -> SpareInfo | None:
        """A spare of ``key``'s namespace and rank for a reservation of ``size`` bytes (one that
        needs no growth if there is one), no longer counted as a spare; None if it has none."""
        where = (key.namespace, key.rank)
        spares = self._spares.get(where)
        if not spares:
            return None
        spare = next((s for s in spares if s.size >= size), spares[0])
        spares.remove(spare)
        if not spares:
            del self._spares[where]
        self._spare_bytes -= spare.size
        return spare

    def _free_spares_locked(self, size: int) -> None:
        """Drop spares, and cancel spares being prepared, until ``size`` more bytes fit in the
        budget (or none is left): the room a real shard needs comes before any spare."""
        while self._in_use_locked() + size > self._budget:
            preparing = next((p for p in self._preparing if not p.cancelled), None)
            if preparing is not None:
                preparing.cancelled = True
                self._preparing_bytes -= preparing.size
                continue
            where = next(iter(self._spares), None)
            if where is None:
                return
            spares = self._spares[where]
            self._drop_spare_locked(spares.pop(0))
            if not spares:
                del self._spares[where]

    def _retire_locked(self, key: ShardKey, *, files: int) -> bool:
        """Keep a primary shard's file as its (namespace, rank)'s spare instead of deleting it:
        the next save of that rank reuses its memory. The rank keeps at most ``files`` files
        (the oldest spares go first). False (nothing done) for a replica or a file that a reader
        here holds."""
        entry = self._index.get(key)
        if entry is None or entry.info.replica_of is not None or self._pins.get(entry.inode):
            return False
        spare_path = entry.info.path.with_name(spare_name(entry.buffer_id))
        try:
            os.replace(entry.info.path, spare_path)
        except OSError:
            return False
        del self._index[key]
        self._touched(key.namespace)
        self._committed_bytes -= entry.info.size
        entry.info.path.with_suffix(META_SUFFIX).unlink(missing_ok=True)
        self._add_spare_locked(
            SpareInfo(key.namespace, key.rank, spare_path, entry.info.size, entry.buffer_id), files=files
        )
        return True

    def _keep_as_spare_locked(self, reservation: Reservation, *, files: int) -> bool:
        """An aborted reservation's file kept as its rank's spare, if it is still the plain file
        reserved (same inode, one link, the reserved size): a trainer writes into these files, so
        whatever it left there is used only as memory to overwrite. False (nothing done) else."""
        temp = reservation.path
        try:
            stat = os.lstat(temp)
        except OSError:
            return False
        if (
            not S_ISREG(stat.st_mode)
            or stat.st_nlink != 1
            or stat.st_ino != reservation._inode
            or stat.st_size != reservation.size
            or reservation.size <= 0
        ):
            return False
        spare_path = temp.with_name(spare_name(reservation.buffer_id))
        try:
            os.replace(temp, spare_path)
        except OSError:
            return False
        key = reservation.key
        self._add_spare_locked(
            SpareInfo(key.namespace, key.rank, spare_path, reservation.size, reservation.buffer_id),
            files=files,
        )
        return True

    def _add_spare_locked(self, spare: SpareInfo, *, files: int) -> None:
        """Hold ``spare``; the rank keeps at most its rotation of ``files`` files (the oldest
        spares go first)."""
        where = (spare.namespace, spare.rank)
        spares = self._spares.setdefault(where, [])
        spares.append(spare)
        self._spare_bytes += spare.size
        while spares and self._files_of_locked(*where) > max(self._rotation_locked(where, files), 1):
            self._drop_spare_locked(spares.pop(0))
        if not spares:
            del self._spares[where]

    def _rotation_locked(self, where: tuple[str, int], files: int) -> int:
        """The files a rank keeps when its retention asks for ``files``: one more while its
        trainer reserves its next write ahead (that write is one of them)."""
        return files + (1 if where in self._ahead_ranks else 0)

    def _drop_spares_locked(self, namespace: str | None = None) -> None:
        """Drop the spares of a namespace (or all), and cancel those being prepared."""
        for where in [w for w in self._spares if namespace is None or w[0] == namespace]:
            for spare in self._spares.pop(where):
                self._drop_spare_locked(spare)
        for preparing in self._preparing:
            if not preparing.cancelled and (namespace is None or preparing.namespace == namespace):
                preparing.cancelled = True
                self._preparing_bytes -= preparing.size
        for where in [w for w in self._rank_sizes if namespace is None or w[0] == namespace]:
            del self._rank_sizes[where]
        self._ahead_ranks -= {w for w in self._ahead_ranks if namespace is None or w[0] == namespace}

    def _drop_spare_locked(self, spare: SpareInfo) -> None:
        self._spare_bytes -= spare.size
        spare.path.unlink(missing_ok=True)
        prune_empty_dirs(spare.path.parent, stop=self._root)

    def _files_of_locked(self, namespace: str, rank: int) -> int:
        """Files a rank holds: its primary shards, its reservations in flight, its spares (made
        or being made)."""
        where = (namespace, rank)
        return (
            sum(
                1
                for key, entry in self._index.items()
                if (key.namespace, key.rank) == (namespace, rank) and entry.info.replica_of is None
            )
            + sum(1 for r in self._reservations if (r.key.namespace, r.key.rank) == (namespace, rank))
            + len(self._spares.get((namespace, rank), ()))
            + sum(1 for p in self._preparing if not p.cancelled and (p.namespace, p.rank) == where)
        )

    def prepare_spares(self, namespace: str, rank: int, *, files: int) -> int:
        """Make the rank hold ``files`` files (its shards, reservations and spares together): new
        spares of the rank's last reserved size, allocated and faulted in here, and spares smaller
        than that grown to it, so that its next reservations get memory already in place. Only
        within the budget (each one must fit, counted in it from the start; a reservation that
        needs the room cancels it). Slow (it touches every page): call it from a worker thread,
        off any request's path. Returns the spares made."""
        where = (namespace, rank)
        with self._lock:
            size = self._rank_sizes.get(where, 0)
            if size <= 0:
                return 0
            self._grow_spares_locked(where, size)
            missing = self._rotation_locked(where, files) - self._files_of_locked(namespace, rank)
        made = 0
        for _ in range(max(0, missing)):
            with self._lock:
                if self._in_use_locked() + size > self._budget:
                    break
                preparing = Preparing(namespace, rank, size)
                self._preparing.append(preparing)
                self._preparing_bytes += size
                try:
                    directory = self._ready_shard_dir(ShardKey(namespace, rank, 0))
                except BaseException:
                    self._end_preparing_locked(preparing)
                    raise
            spare = self._make_spare(preparing, directory)
            if spare is None:
                break
            made += 1
        return made

    def _make_spare(self, preparing: Preparing, directory: Path) -> SpareInfo | None:
        """The file of ``preparing``, allocated and faulted in, registered as a spare; None (and
        nothing left behind) if it was cancelled meanwhile or the memory could not be had."""
        buffer_id = uuid.uuid4().hex
        temp = directory / f".spare.{buffer_id}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
            try:
                prefault(fd, preparing.size)
            finally:
                os.close(fd)
        except OSError:
            temp.unlink(missing_ok=True)
            with self._lock:
                self._end_preparing_locked(preparing)
                prune_empty_dirs(directory, stop=self._root)
            return None
        with self._lock:
            cancelled = preparing.cancelled
            self._end_preparing_locked(preparing)
            if cancelled:
                temp.unlink(missing_ok=True)
                prune_empty_dirs(directory, stop=self._root)
                return None
            path = directory / spare_name(buffer_id)
            os.replace(temp, path)
            spare = SpareInfo(preparing.namespace, preparing.rank, path, preparing.size, buffer_id)
            self._spares.setdefault((preparing.namespace, preparing.rank), []).append(spare)
            self._spare_bytes += spare.size
            return spare

    def _end_preparing_locked(self, preparing: Preparing) -> None:
        self._preparing.remove(preparing)
        if not preparing.cancelled:
            self._preparing_bytes -= preparing.size

    def _grow_spares_locked(self, where: tuple[str, int], size: int) -> None:
        """Spares of ``where`` smaller than ``size`` (a retired shard's file, cut to what it held)
        grown to it and faulted in, when the budget has the room: a trainer maps a buffer at its
        reserved size. Only the growth is touched, so this stays short."""
        spares = self._spares.get(where, [])
        for i, spare in enumerate(spares):
            growth = size - spare.size
            if growth <= 0 or self._in_use_locked() + growth > self._budget:
                continue
            try:
                fd = os.open(spare.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    if not S_ISREG(os.fstat(fd).st_mode):
                        continue
                    prefault(fd, size, start=spare.size)
                finally:
                    os.close(fd)
            except OSError:
                continue
            spares[i] = replace(spare, size=size)
            self._spare_bytes += growth
