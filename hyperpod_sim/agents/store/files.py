"""The shard store's files on disk: their names, the sidecar records and their seal, the store's
key, and the file operations (private directories, hashing with preadv, preallocating and faulting
in memory). See :mod:`agents.store` for the layout and the commit protocol."""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import json
import mmap
import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any

import xxhash

from hyperpod_sim.agents.store.keys import normalized_checksum
from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.contracts.shm import UnsafeDirectory

DATA_SUFFIX = ".shard"
META_SUFFIX = ".meta"
TEMP_SUFFIX = ".tmp"
SPARE_SUFFIX = ".spare"
META_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700
_READ_CHUNK = 1 << 20  # commit_written hashes a trainer's file in pieces of this size
KEY_NAME = "store.key"  # the store's sealing key, in its key directory
KEY_BYTES = 32


def decimal(text: str) -> int | None:
    """The value of a canonical non-negative decimal ("7", not "07" or "+7"), else None."""
    if text.isascii() and text.isdigit() and str(int(text)) == text:
        return int(text)
    return None


def temp_name(step: int, suffix: str) -> str:
    return f".{step}.{uuid.uuid4().hex}{suffix}{TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def make_private_dirs(directory: Path) -> None:
    """``directory`` and its missing parents, each created owner-only (``mkdir -p`` would give the
    parents the umask's mode)."""
    missing: list[Path] = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=DIR_MODE)


def hash_fd(fd: int, size: int) -> str | None:
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


def prune_empty_dirs(directory: Path, *, stop: Path) -> None:
    """Remove ``directory`` and its parents while they are empty, up to (not including) ``stop``."""
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except OSError:
            return
        directory = directory.parent


# ---------------------------------------------------------------------------------------- sidecar


@dataclass(frozen=True)
class Record:
    """What a sidecar says about one data file."""

    size: int
    checksum: str
    replica_of: str | None
    committed_at: float
    inode: int
    save: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "size": self.size,
            "checksum": self.checksum,
            "replica_of": self.replica_of,
            "committed_at": self.committed_at,
            "inode": self.inode,
        }
        if self.save is not None:
            doc["save"] = self.save
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Record:
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
        save = doc.get("save")
        if not (save is None or isinstance(save, str)):
            raise ValueError("save is neither absent nor a string")
        return cls(size, normalized_checksum(checksum), replica_of, float(committed_at), inode, save)


class Seal:
    """The store's seal on its sidecars: an HMAC-SHA256, keyed by a secret only the agent holds,
    of the sidecar's document and the shard it is for (namespace, rank and step, as its path
    names them). A sidecar this store did not write (planted, or moved from another shard's
    place) carries no valid seal, and its shard is not adopted at startup."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def of(self, path: Path, doc: dict[str, Any]) -> str:
        """The seal of sidecar ``doc`` at ``path`` (``<ns>/<rank>/<step>.meta``): over every member
        but ``seal`` itself, so that a member added later is sealed too."""
        shard = f"{path.parent.parent.name}/{path.parent.name}/{path.stem}"
        body = {name: value for name, value in doc.items() if name != "seal"}
        message = json.dumps({"shard": shard, "sidecar": body}, sort_keys=True, separators=(",", ":"))
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def valid(self, path: Path, doc: dict[str, Any]) -> bool:
        seal = doc.get("seal")
        return isinstance(seal, str) and hmac.compare_digest(seal, self.of(path, doc))


def read_sidecar(path: Path, seal: Seal) -> tuple[Record, Record | None] | None:
    """(current, previous) from a sidecar; None if it is missing, not one this store wrote, or
    not sealed by ``seal``."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != META_VERSION or not seal.valid(path, doc):
            return None
        previous = doc.get("previous")
        return Record.from_json(doc.get("current")), None if previous is None else Record.from_json(previous)
    except (OSError, ValueError):
        return None


def write_sidecar(path: Path, *, current: Record, previous: Record | None, seal: Seal) -> None:
    """Replace the sidecar at ``path`` atomically (temp file, then rename), sealed."""
    doc: dict[str, Any] = {
        "version": META_VERSION,
        "current": current.to_json(),
        "previous": None if previous is None else previous.to_json(),
    }
    doc["seal"] = seal.of(path, doc)
    temp = path.with_name(temp_name(int(path.stem), META_SUFFIX))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(doc))
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def load_key(directory: Path) -> bytes:
    """The store's sealing key from ``directory/store.key`` (a private directory), made there on
    first use (random, 0600). UnsafeDirectory if the file is not this user's only; a key file of
    the wrong length (a crash while it was made) is replaced by a new key, so the shards sealed
    with the old one are not adopted."""
    path = directory / KEY_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return _make_key(path)
    except OSError as exc:  # ELOOP: a link in its place
        raise UnsafeDirectory(path, f"cannot be opened as the store's key ({exc.strerror})") from exc
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise UnsafeDirectory(
                path,
                f"is not a file of this user's only (uid {info.st_uid}, mode {info.st_mode & 0o7777:04o}): "
                "it cannot be the store's key",
            )
        key = handle.read(KEY_BYTES + 1)
    return key if len(key) == KEY_BYTES else _make_key(path)


def _make_key(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    temp = path.with_name(f".{KEY_NAME}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with open(fd, "wb") as handle:
            handle.write(key)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return key


def spare_name(buffer_id: str) -> str:
    return f".{buffer_id}{SPARE_SUFFIX}"


def spare_id(name: str) -> str | None:
    """The buffer id a spare's file name holds, or None if it is not a spare's name."""
    if not (name.startswith(".") and name.endswith(SPARE_SUFFIX)):
        return None
    buffer_id = name[1 : -len(SPARE_SUFFIX)]
    valid = len(buffer_id) == 32 and all(c in "0123456789abcdef" for c in buffer_id)
    return buffer_id if valid else None


def prefault(fd: int, size: int, *, start: int = 0) -> None:
    """Size ``fd`` to ``size`` bytes, allocate its pages from ``start`` on and fault them in (a
    populating read mapping zeroes tmpfs pages that fallocate only reserved), so that whoever
    maps it next finds every page in place. OSError (ENOSPC) if the memory cannot be had."""
    os.ftruncate(fd, size)
    if size <= start:
        return
    preallocate(fd, size, start=start)
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


def preallocate(fd: int, size: int, *, start: int = 0) -> None:
    try:
        os.posix_fallocate(fd, start, size - start)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def subdirs(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_dir() and not path.is_symlink())


def matching_record(data_path: Path, meta_path: Path, seal: Seal) -> Record | None:
    """The sealed sidecar record that describes the data file as it is, or None (an uncommitted
    leftover, or files this store did not write).

    A match on ``previous`` (a replacement that crashed before its data rename) rewrites the sidecar.
    """
    sidecar = read_sidecar(meta_path, seal)
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
                write_sidecar(meta_path, current=record, previous=None, seal=seal)
            return record
    return None


def holds_record(data_path: Path, record: Record) -> str | None:
    """Why the data file does not hold what ``record`` says (None if it does): a regular file of
    this user's with one name, the record's inode and size, whose bytes hash to its checksum. The
    sidecar is not trusted over the shard's own bytes."""
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return f"it cannot be opened ({exc.strerror})"
    try:
        info = os.fstat(fd)
        if not S_ISREG(info.st_mode) or info.st_ino != record.inode:
            return "it is not the file its record names"
        if info.st_uid != os.geteuid():
            return f"it belongs to uid {info.st_uid}, not to this agent's user"
        if info.st_nlink != 1:
            return f"it has {info.st_nlink} names (hard links)"
        if info.st_size != record.size:
            return f"it holds {info.st_size} bytes, not {record.size}"
        # Mapped, as a read verifies a committed shard (a copy through preadv took twice as long).
        mapping = mmap.mmap(fd, record.size, access=mmap.ACCESS_READ) if record.size else None
        try:
            actual = checksum_of(mapping if mapping is not None else b"")
        finally:
            if mapping is not None:
                mapping.close()
        if actual != record.checksum:
            return f"its bytes hash to {actual}, not {record.checksum}"
        return None
    finally:
        os.close(fd)
