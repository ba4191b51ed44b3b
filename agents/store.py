"""The shard store of an agent's in-memory checkpoint tier: one plain file per shard, on tmpfs.

A shard is "rank r's bytes of step n of namespace ns" (a ``ShardKey``). The store keeps each one as a
file under ``root`` (on a node, ``/dev/shm/hpsim/<node_id>``): memory that the agent owns and that
outlives a crash of the agent. A restarted agent finds its shards again by scanning ``root``.

Layout on disk::

    root/<ns>/<rank>/<step>.shard    the shard's raw bytes and nothing else (trainers may mmap it)
    root/<ns>/<rank>/<step>.meta     JSON sidecar: {"version": 1, "current": R, "previous": R | null}
    root/<ns>/<rank>/.<id>.spare     a spare: a retired or prepared file, prefaulted, for the next save
    root/<ns>/<rank>/.<...>.tmp      a write in progress (data or sidecar); removed at startup

``<ns>`` is ``quote(namespace, safe="")`` with ``.`` also escaped (``%2E``), so a namespace holding
``/``, spaces or dots is one directory name and never ``.`` or ``..``; its encoded form must fit in
255 bytes. ``<rank>`` and ``<step>`` are decimal. A record ``R`` is ``{"size", "checksum",
"replica_of", "committed_at", "inode"}``: ``inode`` is the inode number of the data file it describes.

Commit protocol (``Reservation.commit``), all under the store's lock:

1. The bytes are already in ``.<step>.<uuid>.shard.tmp`` (created at ``reserve``, preallocated,
   written through a shared mapping).
2. Write the sidecar to a temp file and rename it to ``<step>.meta``: ``current`` describes the new
   data file (its inode), ``previous`` the shard it replaces, if any.
3. Rename the data temp file to ``<step>.shard``.

At startup a shard counts only if its data file is a regular file whose inode and size match the
sidecar's ``current`` record, or its ``previous`` one (a crash between steps 2 and 3 of a replacement:
the old shard is kept and the sidecar rewritten). Anything else (a sidecar without data, data
without a sidecar, a torn or unreadable sidecar) is removed, as are all ``.tmp`` files. So a crash at
any point leaves the old shard or the new one, never a half shard. Files are not fsync'ed: the
store guards against the agent crashing, not the machine (tmpfs does not survive a reboot anyway).
One store per root: two live stores on the same root would remove each other's writes at startup.

Files are the agent's user's only: directories 0700, data files and sidecars 0600 (a trainer that
uses the same-host fast path runs as that user; any other reads over HTTP).

A file handed to a trainer (the same-host fast path) is checked before the agent reads it at
commit: a regular file (not a link, FIFO or device), the very inode reserved, with one name, in
its directory under ``root``, of the reserved size; and it is read with ``preadv``, not mapped, so
a trainer that truncates it even during the check gets its commit refused (``UnusableShardFile``),
never the agent a SIGBUS.

Shards are never written in place: a replacement renames a new file over the old name and an
eviction unlinks it, so a reader that has mapped a shard file keeps seeing one whole shard.

Budget: ``in_use_bytes`` counts committed shards plus reservations in flight (a replacement counts
both copies until it commits). ``reserve`` makes room by evicting whole steps (every local shard of
one ``(namespace, step)``), oldest first by the step's newest ``committed_at``, skipping protected
steps, the new shard's own step and any step with a reservation in flight; it plans the evictions
first and evicts nothing unless the plan makes the shard fit.

Spares (the rotation of a rank's buffers): a primary shard that ages out of retention leaves its
file as a spare of its ``(namespace, rank)`` instead of being deleted, unless a reader here holds it;
``prepare_spares`` also makes new ones in advance, of the rank's last reserved size, allocated and
faulted in (``posix_fallocate`` then a populating mapping), so that a rank holds up to its
retention + 1 files from its first save on and no later save allocates or first-touches memory. A
spare is named by its buffer id and found again at startup. Spares count in the budget, are never
made past it, and are dropped (as few as needed) before any step is evicted for a reservation. A
file is a spare only when no committed shard uses it: a retained step's bytes are never handed out.

Threading: an index guarded by one lock; hashing (at commit and at read) runs outside it, so worker
threads can verify big shards while the event loop keeps using the store. ``protect`` callbacks run
outside the lock too, and at most once per call, only when something has to be evicted.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from io import BufferedReader
from pathlib import Path
from stat import S_ISREG
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote, unquote

import xxhash

from agents.numbers import echo
from contracts.limits import MAX_NAME_BYTES
from contracts.shards import DIGEST_BYTES, checksum_of

StepId = tuple[str, int]  # (namespace, step)
ProtectFn = Callable[[], AbstractSet[StepId]]

DATA_SUFFIX = ".shard"
META_SUFFIX = ".meta"
TEMP_SUFFIX = ".tmp"
META_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700
_READ_CHUNK = 1 << 20  # commit_written hashes a trainer's file in pieces of this size


def _nothing_protected() -> AbstractSet[StepId]:
    return frozenset()


@dataclass(frozen=True, order=True)
class ShardKey:
    namespace: str
    rank: int
    step: int


@dataclass(frozen=True)
class ShardInfo:
    key: ShardKey
    size: int
    # base64 of the 16-byte xxh3_128 digest, as amzn-sagemaker-checkpointing sends in Shard-Meta.
    checksum: str
    # None: this node's own (primary) shard; else the node id whose shard this is a replica of.
    replica_of: str | None
    path: Path  # the data file
    committed_at: float  # the store's clock at commit


@dataclass
class StoreCounters:
    evictions_total: int = 0  # shards removed to make room (reserve, set_budget) or by retention
    # Uploads whose bytes did not match their checksum, and stored copies that failed verification.
    checksum_failures_total: int = 0
    bytes_written_total: int = 0  # bytes of committed shards


class BudgetExceeded(Exception):
    """No room for a shard within the memory budget (the HTTP layer answers 507); nothing was evicted."""

    def __init__(self, *, needed: int, budget: int, in_use: int, message: str | None = None) -> None:
        self.needed = needed
        self.budget = budget
        self.in_use = in_use
        default = f"cannot store {needed} bytes: the memory budget is {budget} bytes and {in_use} are in use"
        super().__init__(message or default)


class CorruptShard(Exception):
    """A shard's bytes do not match its checksum: an upload (nothing stored) or a stored copy (dropped)."""

    def __init__(self, key: ShardKey, *, detail: str) -> None:
        self.key = key
        super().__init__(f"rank {key.rank} step {key.step} of namespace {key.namespace!r}: {detail}")


class UnusableShardFile(Exception):
    """The file of a same-host write is not the one reserved any more (truncated, replaced, moved,
    linked): nothing is stored and the reservation is given back."""

    def __init__(self, key: ShardKey, *, detail: str) -> None:
        self.key = key
        super().__init__(
            f"the file reserved for rank {key.rank} step {key.step} of namespace {echo(key.namespace)} "
            f"cannot be committed: {detail}; nothing was stored"
        )


class ReservationCancelled(Exception):
    """The shard's namespace was deleted (or the store cleared) while it was being written."""

    def __init__(self, key: ShardKey) -> None:
        self.key = key
        super().__init__(
            f"rank {key.rank} step {key.step} of namespace {key.namespace!r} was being written when its "
            "namespace was deleted or the store cleared; nothing was stored"
        )


def _normalized_checksum(checksum: str) -> str:
    """The canonical base64 form of a checksum; ValueError if it is not a 16-byte digest."""
    try:
        digest = base64.b64decode(checksum, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"checksum {checksum!r} is not base64: {exc}") from exc
    if len(digest) != DIGEST_BYTES:
        raise ValueError(
            f"checksum {checksum!r} is {len(digest)} bytes; an xxh3_128 digest is {DIGEST_BYTES}"
        )
    return base64.b64encode(digest).decode("ascii")


# ---------------------------------------------------------------------------------------- names on disk


def _encode_namespace(namespace: str) -> str:
    return quote(namespace, safe="").replace(".", "%2E")


def _decode_namespace(name: str) -> str | None:
    """The namespace a directory name stands for, or None if it is not one this store would write."""
    try:
        namespace = unquote(name, errors="strict")
    except UnicodeDecodeError:
        return None
    return namespace if namespace and _encode_namespace(namespace) == name else None


def _decimal(text: str) -> int | None:
    """The value of a canonical non-negative decimal ("7", not "07" or "+7"), else None."""
    if text.isascii() and text.isdigit() and str(int(text)) == text:
        return int(text)
    return None


def check_namespace(namespace: str) -> None:
    """ValueError unless a namespace of this name can be stored: not empty, and its directory name
    (percent-encoded UTF-8) at most 255 bytes."""
    if not namespace:
        raise ValueError("a namespace must not be empty")
    encoded = len(_encode_namespace(namespace).encode())
    if encoded > MAX_NAME_BYTES:
        raise ValueError(
            f"namespace {echo(namespace)} is too long: {encoded} bytes once encoded for its directory name; "
            f"at most {MAX_NAME_BYTES} are allowed"
        )


def _check_key(key: ShardKey) -> None:
    check_namespace(key.namespace)
    if key.rank < 0 or key.step < 0:
        raise ValueError(f"rank and step must not be negative (got rank {key.rank}, step {key.step})")


def _temp_name(step: int, suffix: str) -> str:
    return f".{step}.{uuid.uuid4().hex}{suffix}{TEMP_SUFFIX}"


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def _make_private_dirs(directory: Path) -> None:
    """``directory`` and its missing parents, each created owner-only (``mkdir -p`` would give the
    parents the umask's mode)."""
    missing: list[Path] = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=DIR_MODE)


def _hash_fd(fd: int, size: int) -> str | None:
    """The checksum of the first ``size`` bytes of ``fd``, read with preadv (no mapping: a file
    cut short meanwhile is a short read here, not a SIGBUS); None if it holds fewer bytes."""
    hasher = xxhash.xxh3_128()
    buffer = memoryview(bytearray(min(size, _READ_CHUNK)))
    done = 0
    while done < size:
        count = os.preadv(fd, [buffer[: min(len(buffer), size - done)]], done)
        if count <= 0:
            return None
        hasher.update(buffer[:count])
        done += count
    return base64.b64encode(hasher.digest()).decode("ascii")


def _prune_empty_dirs(directory: Path, *, stop: Path) -> None:
    """Remove ``directory`` and its parents while they are empty, up to (not including) ``stop``."""
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


# ---------------------------------------------------------------------------------------- sidecar


@dataclass(frozen=True)
class _Record:
    """What a sidecar says about one data file."""

    size: int
    checksum: str
    replica_of: str | None
    committed_at: float
    inode: int

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "checksum": self.checksum,
            "replica_of": self.replica_of,
            "committed_at": self.committed_at,
            "inode": self.inode,
        }

    @classmethod
    def from_json(cls, doc: Any) -> _Record:
        """ValueError unless ``doc`` is a record this store wrote."""
        if not isinstance(doc, dict):
            raise ValueError("a record is an object")
        size, inode, checksum = doc.get("size"), doc.get("inode"), doc.get("checksum")
        replica_of, committed_at = doc.get("replica_of"), doc.get("committed_at")
        if not (isinstance(size, int) and isinstance(inode, int) and isinstance(checksum, str)):
            raise ValueError("size, inode and checksum are missing or mistyped")
        if not (replica_of is None or isinstance(replica_of, str)):
            raise ValueError("replica_of is neither null nor a string")
        if not isinstance(committed_at, int | float) or isinstance(committed_at, bool):
            raise ValueError("committed_at is not a number")
        return cls(size, _normalized_checksum(checksum), replica_of, float(committed_at), inode)


def _read_sidecar(path: Path) -> tuple[_Record, _Record | None] | None:
    """(current, previous) from a sidecar; None if it is missing or not one this store wrote."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != META_VERSION:
            return None
        previous = doc.get("previous")
        return _Record.from_json(doc.get("current")), None if previous is None else _Record.from_json(
            previous
        )
    except (OSError, ValueError):
        return None


def _write_sidecar(path: Path, *, current: _Record, previous: _Record | None) -> None:
    """Replace the sidecar at ``path`` atomically (temp file, then rename)."""
    doc = {
        "version": META_VERSION,
        "current": current.to_json(),
        "previous": None if previous is None else previous.to_json(),
    }
    temp = path.with_name(_temp_name(int(path.stem), META_SUFFIX))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(doc))
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class SpareInfo:
    """A file kept (and counted in the budget) for the next reservation of its namespace and rank:
    a retired shard's or one prepared in advance, already allocated and faulted in."""

    namespace: str
    rank: int
    path: Path
    size: int
    buffer_id: str


_Spare = SpareInfo
SPARE_SUFFIX = ".spare"


def _spare_name(buffer_id: str) -> str:
    return f".{buffer_id}{SPARE_SUFFIX}"


def _spare_id(name: str) -> str | None:
    """The buffer id a spare's file name holds, or None if it is not a spare's name."""
    if not (name.startswith(".") and name.endswith(SPARE_SUFFIX)):
        return None
    buffer_id = name[1 : -len(SPARE_SUFFIX)]
    valid = len(buffer_id) == 32 and all(c in "0123456789abcdef" for c in buffer_id)
    return buffer_id if valid else None


@dataclass
class _Preparing:
    """A spare being made (outside the lock): its bytes count in the budget until it is a spare,
    or until a reservation that needs the room cancels it."""

    namespace: str
    rank: int
    size: int
    cancelled: bool = False


@dataclass(frozen=True)
class _Entry:
    """An index entry: a committed shard, the inode of its data file and the buffer id that names
    that file (unique per file: trainers keep their mappings by it)."""

    info: ShardInfo
    inode: int
    buffer_id: str

    @property
    def record(self) -> _Record:
        info = self.info
        return _Record(info.size, info.checksum, info.replica_of, info.committed_at, self.inode)


# ---------------------------------------------------------------------------------------- reservation

_State = Literal["open", "committed", "aborted"]


class Reservation:
    """A shard being written: room reserved in the budget and a temporary file mapped for writing.

    Use: ``buffer()``, fill it, then ``commit()`` or ``abort()``. Either one ends the reservation; it
    is also a context manager that aborts on exit unless committed. Release the views that
    ``buffer()`` returned (``view.release()`` or ``with reservation.buffer() as view:``) before
    commit or abort, so the mapping is unmapped at once; a view still held keeps the mapping (not
    the reservation) alive until it is released. One writer per reservation.
    """

    def __init__(
        self, *, store: ShardStore, key: ShardKey, size: int, temp_path: Path, buffer_id: str
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
        self._state: _State = "open"
        self._cancelled = False

    @property
    def key(self) -> ShardKey:
        return self._key

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

    def commit_written(self, *, size: int, replica_of: str | None = None) -> ShardInfo:
        """Commit the first ``size`` bytes (at most the reserved size), with the checksum computed
        here: for bytes another process on this host wrote into ``path``. The rest of the
        reservation is given back."""
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
                checksum = _hash_fd(fd, size)
            finally:
                os.close(fd)
            if checksum is None:
                raise UnusableShardFile(self._key, detail="it was cut short while it was being read")
            return self._store._publish(self, checksum=checksum, replica_of=replica_of)
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

    def commit(self, *, checksum: str, replica_of: str | None = None, verify: bool = True) -> ShardInfo:
        """Make the written bytes the shard of ``key``, replacing any shard of that key, atomically.

        ``verify``: hash the written bytes first (outside the store's lock). Either the shard is
        stored and its info returned, or the reservation is aborted (nothing stored) and this raises:
        CorruptShard (bytes do not match ``checksum``), ValueError (``checksum`` is not a base64
        16-byte digest), ReservationCancelled (namespace deleted meanwhile) or OSError.
        """
        self._require_open()
        try:
            expected = _normalized_checksum(checksum)
            if verify:
                self._verify(expected)
            self._release_mapping()
            return self._store._publish(self, checksum=expected, replica_of=replica_of)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Release the reserved bytes and delete the temporary file. Idempotent; no-op after commit."""
        self._store._release(self)

    # -- used by the store

    def _prepare(self, fd: int) -> None:
        """Size the new file, allocate its memory now (ENOSPC here, not SIGBUS later), map it."""
        try:
            if self._size > 0:
                # A reused spare is allocated up to its size already: allocate only what is new
                # (fallocate walks every page of its range, even pages it need not allocate).
                current = os.fstat(fd).st_size
                if current < self._size:
                    _preallocate(fd, self._size, start=current)
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


def _prefault(fd: int, size: int, *, start: int = 0) -> None:
    """Size ``fd`` to ``size`` bytes, allocate its pages from ``start`` on and fault them in (a
    populating read mapping zeroes tmpfs pages that fallocate only reserved), so that whoever
    maps it next finds every page in place. OSError (ENOSPC) if the memory cannot be had."""
    os.ftruncate(fd, size)
    if size <= start:
        return
    _preallocate(fd, size, start=start)
    page = mmap.ALLOCATIONGRANULARITY
    offset = start - start % page
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(
        fd, size - offset, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ, offset=offset
    )
    if not populate:  # not Linux: touch a byte of every page
        for position in range(0, size - offset, page):
            mapping[position]
    mapping.close()


def _preallocate(fd: int, size: int, *, start: int = 0) -> None:
    try:
        os.posix_fallocate(fd, start, size - start)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


# ---------------------------------------------------------------------------------------- the store


class ShardStore:
    """Shards in files under ``root``, indexed in memory, within a memory budget (0: tiering off)."""

    def __init__(self, root: Path, *, budget_bytes: int = 0, clock: Callable[[], float] = time.time) -> None:
        """Create ``root`` if needed and rebuild the index from it (see the module docstring).

        Shards found are kept even beyond ``budget_bytes``; the next ``set_budget`` evicts down.
        """
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must not be negative (got {budget_bytes})")
        self._root = Path(root)
        self._budget = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._index: dict[ShardKey, _Entry] = {}
        self._committed_bytes = 0
        self._reserved_bytes = 0
        self._reservations: set[Reservation] = set()
        # Files kept for the next reservations of their (namespace, rank), oldest first: retired
        # primary shards and files prepared in advance (``prepare_spares``).
        self._spares: dict[tuple[str, int], list[_Spare]] = {}
        self._spare_bytes = 0
        self._preparing: list[_Preparing] = []
        self._preparing_bytes = 0
        # (namespace, rank) -> the size of its last primary reservation: what spares are made for.
        self._rank_sizes: dict[tuple[str, int], int] = {}
        # inode -> readers in this process (replication, S3 uploads, responses): not recycled.
        self._pins: dict[int, int] = {}
        self._counters = StoreCounters()
        _make_private_dirs(self._root)
        if self._root.stat().st_uid == os.getuid():
            os.chmod(self._root, DIR_MODE)  # a root made by an older agent, or by hand
        self._real_root = Path(os.path.realpath(self._root))
        self._recover()

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

    @property
    def counters(self) -> StoreCounters:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._counters)

    # -- budget

    def set_budget(self, budget_bytes: int, *, protect: ProtectFn = _nothing_protected) -> list[ShardKey]:
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

    def reserve(self, key: ShardKey, size: int, *, protect: ProtectFn = _nothing_protected) -> Reservation:
        """Room for ``size`` bytes of ``key`` and a file to write them into (see ``Reservation``).

        If the budget is short, evicts whole steps, oldest first, never a step in ``protect()``
        (called only then), ``key``'s own step or a step being written; raises BudgetExceeded,
        evicting nothing, when that cannot make the shard fit or the budget is 0 (tiering off).
        Raises OSError if the memory cannot be allocated (tmpfs full).
        """
        _check_key(key)
        if size < 0:
            raise ValueError(f"size must not be negative (got {size})")
        reservation, fd = self._reserve_locked_or_evict(key, size, protect)
        try:
            reservation._prepare(fd)
        except BaseException:
            reservation.abort()
            raise
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

    def _in_use_locked(self) -> int:
        return self._committed_bytes + self._reserved_bytes + self._spare_bytes + self._preparing_bytes

    def _take_spare_locked(self, key: ShardKey, size: int) -> _Spare | None:
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

    def _open_locked(self, key: ShardKey, size: int, spare: _Spare | None) -> tuple[Reservation, int]:
        """A new reservation and the fd of its temporary file (a spare's, else a new empty one);
        counted in in_use at once."""
        directory = self._ready_shard_dir(key)
        temp = directory / _temp_name(key.step, DATA_SUFFIX)
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

    def _publish(self, reservation: Reservation, *, checksum: str, replica_of: str | None) -> ShardInfo:
        """Commit steps 2 and 3 (module docstring), then the index."""
        key = reservation.key
        with self._lock:
            reservation._require_open()
            if reservation._cancelled:
                raise ReservationCancelled(key)
            old = self._index.get(key)
            data_path = self._data_path(key)
            record = _Record(reservation.size, checksum, replica_of, self._clock(), reservation._inode)
            _write_sidecar(
                data_path.with_suffix(META_SUFFIX),
                current=record,
                previous=None if old is None else old.record,
            )
            os.replace(reservation._temp_path, data_path)
            self._end_reservation_locked(reservation, state="committed")
            if old is not None:
                self._committed_bytes -= old.info.size
            entry = _Entry(
                ShardInfo(key, record.size, checksum, replica_of, data_path, record.committed_at),
                record.inode,
                reservation.buffer_id,
            )
            self._index[key] = entry
            self._committed_bytes += record.size
            self._counters.bytes_written_total += record.size
            if replica_of is None:
                self._rank_sizes[(key.namespace, key.rank)] = reservation._reserved_size
            return entry.info

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            if reservation._state != "open":
                return
            self._end_reservation_locked(reservation, state="aborted")
            reservation._temp_path.unlink(missing_ok=True)
            _prune_empty_dirs(reservation._temp_path.parent, stop=self._root)

    def _end_reservation_locked(self, reservation: Reservation, *, state: _State) -> None:
        reservation._state = state
        reservation._release_mapping()
        self._reservations.discard(reservation)
        self._reserved_bytes -= reservation.size

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

    def _open_entry(self, key: ShardKey) -> tuple[_Entry, int]:
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

    def _verified_mapping(self, entry: _Entry, fd: int) -> mmap.mmap | None:
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
        self, namespace: str, keep_steps: int, *, protect: ProtectFn = _nothing_protected
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

    def _retire_locked(self, key: ShardKey, *, files: int) -> bool:
        """Keep a primary shard's file as its (namespace, rank)'s spare instead of deleting it:
        the next save of that rank reuses its memory. The rank keeps at most ``files`` files
        (the oldest spares go first). False (nothing done) for a replica or a file that a reader
        here holds."""
        entry = self._index.get(key)
        if entry is None or entry.info.replica_of is not None or self._pins.get(entry.inode):
            return False
        spare_path = entry.info.path.with_name(_spare_name(entry.buffer_id))
        try:
            os.replace(entry.info.path, spare_path)
        except OSError:
            return False
        del self._index[key]
        self._committed_bytes -= entry.info.size
        entry.info.path.with_suffix(META_SUFFIX).unlink(missing_ok=True)
        where = (key.namespace, key.rank)
        spares = self._spares.setdefault(where, [])
        spares.append(_Spare(key.namespace, key.rank, spare_path, entry.info.size, entry.buffer_id))
        self._spare_bytes += entry.info.size
        while spares and self._files_of_locked(*where) > max(files, 1):
            self._drop_spare_locked(spares.pop(0))
        if not spares:
            del self._spares[where]
        return True

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

    def _drop_spare_locked(self, spare: _Spare) -> None:
        self._spare_bytes -= spare.size
        spare.path.unlink(missing_ok=True)
        _prune_empty_dirs(spare.path.parent, stop=self._root)

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
            missing = files - self._files_of_locked(namespace, rank)
        made = 0
        for _ in range(max(0, missing)):
            with self._lock:
                if self._in_use_locked() + size > self._budget:
                    break
                preparing = _Preparing(namespace, rank, size)
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

    def _make_spare(self, preparing: _Preparing, directory: Path) -> _Spare | None:
        """The file of ``preparing``, allocated and faulted in, registered as a spare; None (and
        nothing left behind) if it was cancelled meanwhile or the memory could not be had."""
        buffer_id = uuid.uuid4().hex
        temp = directory / f".spare.{buffer_id}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
            try:
                _prefault(fd, preparing.size)
            finally:
                os.close(fd)
        except OSError:
            temp.unlink(missing_ok=True)
            with self._lock:
                self._end_preparing_locked(preparing)
                _prune_empty_dirs(directory, stop=self._root)
            return None
        with self._lock:
            cancelled = preparing.cancelled
            self._end_preparing_locked(preparing)
            if cancelled:
                temp.unlink(missing_ok=True)
                _prune_empty_dirs(directory, stop=self._root)
                return None
            path = directory / _spare_name(buffer_id)
            os.replace(temp, path)
            spare = _Spare(preparing.namespace, preparing.rank, path, preparing.size, buffer_id)
            self._spares.setdefault((preparing.namespace, preparing.rank), []).append(spare)
            self._spare_bytes += spare.size
            return spare

    def _end_preparing_locked(self, preparing: _Preparing) -> None:
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
                    _prefault(fd, size, start=spare.size)
                finally:
                    os.close(fd)
            except OSError:
                continue
            spares[i] = replace(spare, size=size)
            self._spare_bytes += growth

    def _remove_locked(self, key: ShardKey) -> bool:
        """Drop a shard from the index and the disk (data first, then its sidecar)."""
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._committed_bytes -= entry.info.size
        entry.info.path.unlink(missing_ok=True)
        entry.info.path.with_suffix(META_SUFFIX).unlink(missing_ok=True)
        _prune_empty_dirs(entry.info.path.parent, stop=self._root)
        return True

    # -- layout and recovery

    def _shard_dir(self, key: ShardKey) -> Path:
        return self._root / _encode_namespace(key.namespace) / str(key.rank)

    def _ready_shard_dir(self, key: ShardKey) -> Path:
        """The shard's directory, made if missing. A link put in place of the namespace's or the
        rank's directory is removed first: the store writes under its root only."""
        directory = self._shard_dir(key)
        _make_private_dirs(directory)
        if Path(os.path.realpath(directory)) != self._real_shard_dir(key):
            for path in (directory.parent, directory):
                if path.is_symlink():
                    path.unlink()
            _make_private_dirs(directory)
            if Path(os.path.realpath(directory)) != self._real_shard_dir(key):
                raise OSError(f"{directory} does not resolve to a directory under the store's root")
        return directory

    def _real_shard_dir(self, key: ShardKey) -> Path:
        """Where ``_shard_dir(key)`` must resolve to: under the root as it resolved at start."""
        return self._real_root / _encode_namespace(key.namespace) / str(key.rank)

    def _data_path(self, key: ShardKey) -> Path:
        return self._shard_dir(key) / f"{key.step}{DATA_SUFFIX}"

    def _recover(self) -> None:
        """Rebuild the index from the files under root; remove what uncommitted writes left behind."""
        for ns_dir in _subdirs(self._root):
            namespace = _decode_namespace(ns_dir.name)
            if namespace is None:
                continue
            with contextlib.suppress(OSError):
                os.chmod(ns_dir, DIR_MODE)  # an older agent's 0755
            for rank_dir in _subdirs(ns_dir):
                rank = _decimal(rank_dir.name)
                if rank is not None:
                    with contextlib.suppress(OSError):
                        os.chmod(rank_dir, DIR_MODE)
                    self._recover_rank_dir(namespace, rank, rank_dir)
                    _prune_empty_dirs(rank_dir, stop=self._root)

    def _recover_rank_dir(self, namespace: str, rank: int, directory: Path) -> None:
        steps: set[int] = set()
        for name in sorted(os.listdir(directory)):
            if _is_temp_name(name):
                (directory / name).unlink(missing_ok=True)
                continue
            buffer_id = _spare_id(name)
            if buffer_id is not None:
                self._recover_spare(namespace, rank, directory / name, buffer_id)
                continue
            stem, dot, suffix = name.partition(".")
            step = _decimal(stem)
            if step is not None and f"{dot}{suffix}" in (DATA_SUFFIX, META_SUFFIX):
                steps.add(step)
        for step in sorted(steps):
            self._recover_shard(ShardKey(namespace, rank, step))

    def _recover_spare(self, namespace: str, rank: int, path: Path, buffer_id: str) -> None:
        """Keep a spare found at startup (an agent that restarts keeps its rank's rotation); one
        that is not a plain file of this store's is removed."""
        try:
            stat = path.lstat()
        except FileNotFoundError:
            return
        if not S_ISREG(stat.st_mode) or stat.st_nlink != 1:
            path.unlink(missing_ok=True)
            return
        with contextlib.suppress(OSError):
            os.chmod(path, FILE_MODE)
        self._spares.setdefault((namespace, rank), []).append(
            _Spare(namespace, rank, path, stat.st_size, buffer_id)
        )
        self._spare_bytes += stat.st_size
        # Spares are made at the size the rank reserves: the next ones are made alike.
        self._rank_sizes[(namespace, rank)] = max(self._rank_sizes.get((namespace, rank), 0), stat.st_size)

    def _recover_shard(self, key: ShardKey) -> None:
        data_path = self._data_path(key)
        meta_path = data_path.with_suffix(META_SUFFIX)
        record = _matching_record(data_path, meta_path)
        if record is None:
            data_path.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
            return
        for path in (data_path, meta_path):
            with contextlib.suppress(OSError):
                os.chmod(path, FILE_MODE)  # an older agent's 0644
        info = ShardInfo(key, record.size, record.checksum, record.replica_of, data_path, record.committed_at)
        # A buffer id of its own: it names this file to the trainers that map it (by buffer id),
        # also once the file is retired and reused for a later save of its rank.
        self._index[key] = _Entry(info, record.inode, uuid.uuid4().hex)
        self._committed_bytes += record.size


def _subdirs(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_dir() and not path.is_symlink())


def _matching_record(data_path: Path, meta_path: Path) -> _Record | None:
    """The sidecar record that describes the data file as it is, or None (an uncommitted leftover).

    A match on ``previous`` (a replacement that crashed before its data rename) rewrites the sidecar.
    """
    sidecar = _read_sidecar(meta_path)
    try:
        stat = data_path.lstat()
    except FileNotFoundError:
        return None
    if sidecar is None or not S_ISREG(stat.st_mode):
        return None
    current, previous = sidecar
    for record in (current, previous):
        if record is not None and record.inode == stat.st_ino and record.size == stat.st_size:
            if record is previous:
                _write_sidecar(meta_path, current=record, previous=None)
            return record
    return None
