"""A shard being written into the store (see :mod:`agents.store`, "Commit protocol")."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from stat import S_ISREG
from types import TracebackType
from typing import Literal, Protocol

from hyperpod_sim.agents.store.files import hash_fd, preallocate
from hyperpod_sim.agents.store.keys import (
    CorruptShard,
    ShardInfo,
    ShardKey,
    UnusableShardFile,
    normalized_checksum,
)
from hyperpod_sim.contracts.shards import checksum_of


class ReservationOwner(Protocol):
    """What a reservation needs of its store (:class:`agents.store.ShardStore`), which does the
    bookkeeping under its lock."""

    def _publish(
        self, reservation: Reservation, *, checksum: str, replica_of: str | None, save: str | None = None
    ) -> ShardInfo: ...

    def _release(self, reservation: Reservation, *, spare_files: int | None = None) -> None: ...

    def _rebind(self, reservation: Reservation, key: ShardKey) -> None: ...

    def _shrink(self, reservation: Reservation, size: int) -> None: ...

    def _count_checksum_failure(self) -> None: ...

    def _real_shard_dir(self, key: ShardKey) -> Path: ...


ReservationState = Literal["open", "committed", "aborted"]


class Reservation:
    """A shard being written: room reserved in the budget and a temporary file mapped for writing.

    Use: ``buffer()``, fill it, then ``commit()`` or ``abort()``. Either one ends the reservation; it
    is also a context manager that aborts on exit unless committed. Release the views that
    ``buffer()`` returned (``view.release()`` or ``with reservation.buffer() as view:``) before
    commit or abort, so the mapping is unmapped at once; a view still held keeps the mapping (not
    the reservation) alive until it is released. One writer per reservation.
    """

    def __init__(
        self, *, store: ReservationOwner, key: ShardKey, size: int, temp_path: Path, buffer_id: str
    ) -> None:
        self._store = store
        self._key = key
        self._size = size
        self._reserved_size = size  # as asked for; ``_size`` shrinks to what is committed
        self._temp_path = temp_path
        self._buffer_id = buffer_id
        self._mapping: mmap.mmap | None = None
        self._inode = 0
        self._device = 0
        self._state: ReservationState = "open"
        self._cancelled = False
        self._ahead = False  # reserved before its step was known (``rebind``)

    @property
    def key(self) -> ShardKey:
        return self._key

    @property
    def ahead(self) -> bool:
        """Reserved as its rank's next write, before its step was known (``rebind`` names it)."""
        return self._ahead

    def rebind(self, step: int) -> None:
        """Make an open reservation the shard of ``step`` (same namespace and rank): a write
        reserved ahead is committed as the step its trainer saved. ReservationCancelled if the
        namespace was deleted or reset meanwhile."""
        self._store._rebind(self, ShardKey(self._key.namespace, self._key.rank, step))

    @property
    def size(self) -> int:
        return self._size

    @property
    def path(self) -> Path:
        """The file being written (a process on this host may map it and write into it)."""
        return self._temp_path

    @property
    def buffer_id(self) -> str:
        """Names the file's memory across steps: a retired shard's file is reused for the next
        reservation of the same namespace and rank, keeping its buffer id (and inode), so a
        writer that keeps its mapping by buffer id writes into pages already in place."""
        return self._buffer_id

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()

    def buffer(self) -> memoryview:
        """A writable view over the new file, exactly ``size`` bytes long (size 0: an empty view)."""
        self._require_open()
        if self._mapping is None:
            return memoryview(bytearray())
        return memoryview(self._mapping)

    def commit_written(
        self, *, size: int, replica_of: str | None = None, save: str | None = None
    ) -> ShardInfo:
        """Commit the first ``size`` bytes (at most the reserved size), with the checksum computed
        here: for bytes another process on this host wrote into ``path``. The rest of the
        reservation is given back. ``save``: the save of its step the shard belongs to."""
        self._require_open()
        try:
            if not 0 <= size <= self._size:
                raise ValueError(f"{size} bytes were written into a reservation of {self._size}")
            self._release_mapping()  # the agent never touches a trainer's file through a mapping
            fd = self._open_checked(os.O_RDWR if size < self._size else os.O_RDONLY)
            try:
                if size < self._size:
                    os.ftruncate(fd, size)
                    self._store._shrink(self, size)
                checksum = hash_fd(fd, size)
            finally:
                os.close(fd)
            if checksum is None:
                raise UnusableShardFile(self._key, detail="it was cut short while it was being read")
            return self._store._publish(self, checksum=checksum, replica_of=replica_of, save=save)
        except BaseException:
            self.abort()
            raise

    def _open_checked(self, flags: int) -> int:
        """An fd of the reserved file, once it is known to be that file: in its directory under
        the store's root (no directory swapped for a link), not a link itself, a regular file,
        the inode reserved (same device) with no other name, of the reserved size.
        UnusableShardFile otherwise."""
        path = self._temp_path
        if Path(os.path.realpath(path.parent)) != self._store._real_shard_dir(self._key):
            raise UnusableShardFile(self._key, detail="its directory is no longer under the agent's root")
        try:
            # O_NONBLOCK: a FIFO put in its place must not block the open.
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise UnusableShardFile(self._key, detail=f"it cannot be opened ({exc.strerror})") from exc
        try:
            stat = os.fstat(fd)
            problem = None
            if not S_ISREG(stat.st_mode):
                problem = "it is not a regular file"
            elif (stat.st_dev, stat.st_ino) != (self._device, self._inode):
                problem = "it was replaced by another file"
            elif stat.st_nlink != 1:
                problem = f"it has {stat.st_nlink} names (hard links)"
            elif stat.st_size != self._size:
                problem = f"it holds {stat.st_size} bytes, not the {self._size} reserved"
            if problem is not None:
                raise UnusableShardFile(self._key, detail=problem)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def commit(
        self, *, checksum: str, replica_of: str | None = None, verify: bool = True, save: str | None = None
    ) -> ShardInfo:
        """Make the written bytes the shard of ``key``, replacing any shard of that key, atomically.

        ``verify``: hash the written bytes first (outside the store's lock). Either the shard is
        stored and its info returned, or the reservation is aborted (nothing stored) and this raises:
        CorruptShard (bytes do not match ``checksum``), ValueError (``checksum`` is not a base64
        16-byte digest), ReservationCancelled (namespace deleted meanwhile) or OSError.
        """
        self._require_open()
        try:
            expected = normalized_checksum(checksum)
            if verify:
                self._verify(expected)
            self._release_mapping()
            return self._store._publish(self, checksum=expected, replica_of=replica_of, save=save)
        except BaseException:
            self.abort()
            raise

    def abort(self, *, keep_as_spare: int | None = None) -> None:
        """Release the reserved bytes and delete the temporary file. Idempotent; no-op after commit.
        ``keep_as_spare``: keep the file (still the plain file reserved, at its size) as the rank's
        spare instead, the rank holding at most that many files: a write reserved ahead that its
        trainer gave back unused is a file of the rank's rotation."""
        self._store._release(self, spare_files=keep_as_spare)

    # -- used by the store

    def _prepare(self, fd: int) -> None:
        """Size the new file, allocate its memory now (ENOSPC here, not SIGBUS later), map it."""
        try:
            if self._size > 0:
                # A reused spare is allocated up to its size already: allocate only what is new
                # (fallocate walks every page of its range, even pages it need not allocate).
                current = os.fstat(fd).st_size
                if current < self._size:
                    preallocate(fd, self._size, start=current)
                os.ftruncate(fd, self._size)
                self._mapping = mmap.mmap(fd, self._size)
            stat = os.fstat(fd)
            self._inode, self._device = stat.st_ino, stat.st_dev
        finally:
            os.close(fd)

    def _verify(self, expected: str) -> None:
        actual = checksum_of(self._mapping if self._mapping is not None else b"")
        if actual != expected:
            self._store._count_checksum_failure()
            raise CorruptShard(self._key, detail=f"the bytes received hash to {actual}, not {expected}")

    def _release_mapping(self) -> None:
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # a view is still held: unmapped when it is released
                self._mapping.close()
            self._mapping = None

    def _require_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"the reservation for {self._key} is already {self._state}")
