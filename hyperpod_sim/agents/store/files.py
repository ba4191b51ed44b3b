"""The shard store's files on disk: their names, the sidecar records, and the file operations
(private directories, hashing with preadv, preallocating and faulting in memory). See
:mod:`agents.store` for the layout and the commit protocol."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import mmap
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any

import xxhash

from hyperpod_sim.agents.store.keys import normalized_checksum

DATA_SUFFIX = ".shard"
META_SUFFIX = ".meta"
TEMP_SUFFIX = ".tmp"
SPARE_SUFFIX = ".spare"
META_VERSION = 1
FILE_MODE = 0o600
DIR_MODE = 0o700
_READ_CHUNK = 1 << 20  # commit_written hashes a trainer's file in pieces of this size


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

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "checksum": self.checksum,
            "replica_of": self.replica_of,
            "committed_at": self.committed_at,
            "inode": self.inode,
        }

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
        return cls(size, normalized_checksum(checksum), replica_of, float(committed_at), inode)


def read_sidecar(path: Path) -> tuple[Record, Record | None] | None:
    """(current, previous) from a sidecar; None if it is missing or not one this store wrote."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != META_VERSION:
            return None
        previous = doc.get("previous")
        return Record.from_json(doc.get("current")), None if previous is None else Record.from_json(previous)
    except (OSError, ValueError):
        return None


def write_sidecar(path: Path, *, current: Record, previous: Record | None) -> None:
    """Replace the sidecar at ``path`` atomically (temp file, then rename)."""
    doc = {
        "version": META_VERSION,
        "current": current.to_json(),
        "previous": None if previous is None else previous.to_json(),
    }
    temp = path.with_name(temp_name(int(path.stem), META_SUFFIX))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(doc))
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


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


def matching_record(data_path: Path, meta_path: Path) -> Record | None:
    """The sidecar record that describes the data file as it is, or None (an uncommitted leftover).

    A match on ``previous`` (a replacement that crashed before its data rename) rewrites the sidecar.
    """
    sidecar = read_sidecar(meta_path)
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
                write_sidecar(meta_path, current=record, previous=None)
            return record
    return None
