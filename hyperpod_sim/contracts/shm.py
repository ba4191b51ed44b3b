"""Who may own the shared-memory tree: the rule that ``serve`` (for its root,
``HPSIM_SIMULATION__SHM_ROOT``) and each agent (for its node's directory and what is below it)
apply at start, so that the checkpoints in it are the agent's user's only (docs/security.md,
"Files").

``/dev/shm`` is writable by every local user and empty after a reboot, so whoever makes
``/dev/shm/hpsim`` first owns it, and the owner of a directory can rename or replace whatever is
in it. So a directory of the tree is used only when no other user can change it:

- the directory itself, and every directory of the tree below it, belongs to this process's user
  and is writable by no one else (no group or world write bit); a missing one is made with mode
  0700, and one of ours with a looser mode (an older agent's 0755) is tightened to 0700;
- every directory above it belongs to root or to this user and is writable by no one else, unless
  its sticky bit keeps others from renaming what they do not own (``/dev/shm`` and ``/tmp`` are
  1777); a symbolic link on the way must belong to root or to this user too.

Anything else is refused with :class:`UnsafeDirectory`, which names the path and what is wrong.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIR_MODE = 0o700
_MAX_LINKS = 40  # as the kernel's limit on symbolic links in one lookup


class UnsafeDirectory(Exception):
    """A directory of the shared-memory tree (or one above it) that another user could change."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path} {problem}")


def private_directory(path: Path) -> Path:
    """Make ``path`` (and its missing parents) a directory of this user's only, or refuse it
    (:class:`UnsafeDirectory`); its real path. What exists above is checked before anything is
    made, and all of it again after, so that a directory another user makes in the meantime under
    a sticky parent is refused, never used."""
    path = Path(os.path.abspath(path))
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    if missing:
        real_probe = _check_ancestors(probe)
        _check_above(real_probe, os.lstat(real_probe), os.geteuid())
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=DIR_MODE)
    real = _check_ancestors(path)
    info = os.lstat(real)
    check_owned(real, info)
    if stat.S_IMODE(info.st_mode) != DIR_MODE:
        os.chmod(real, DIR_MODE)
    return real


def check_owned(path: Path, info: os.stat_result) -> None:
    """UnsafeDirectory unless ``info`` (an lstat of ``path``) is a directory of this user's that
    no one else may write."""
    uid = os.geteuid()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(path, "is not a directory")
    if info.st_uid != uid:
        raise UnsafeDirectory(
            path,
            f"belongs to uid {info.st_uid}, not to this process's user (uid {uid}): another local user "
            "made it and could rename or replace what is in it",
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(
            path,
            f"has mode {stat.S_IMODE(info.st_mode):04o}: other users may write into it (it must be "
            "writable by its owner only, 0700)",
        )


def _check_ancestors(path: Path) -> Path:
    """The real path of ``path``, once every directory and link above it is known to be safe."""
    uid = os.geteuid()
    pending = list(path.parts[1:])
    current = Path(path.anchor)
    links = 0
    while True:
        if len(pending) == 0:
            return current
        _check_above(current, os.lstat(current), uid)
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        info = os.lstat(candidate)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise UnsafeDirectory(path, "has too many symbolic links on its way")
            if info.st_uid not in (0, uid):
                raise UnsafeDirectory(
                    candidate, f"is a symbolic link of uid {info.st_uid}, who could point it elsewhere"
                )
            target = Path(os.readlink(candidate))
            if target.is_absolute():
                current = Path(target.anchor)
            pending = list(target.parts[1:] if target.is_absolute() else target.parts) + pending
            continue
        current = candidate


def _check_above(path: Path, info: os.stat_result, uid: int) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(path, "is not a directory")
    if info.st_uid not in (0, uid):
        raise UnsafeDirectory(
            path,
            f"belongs to uid {info.st_uid}, neither root nor this process's user (uid {uid}): that "
            "user could rename what is in it",
        )
    writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            path,
            f"has mode {stat.S_IMODE(info.st_mode):04o}: other users may rename what is in it (a "
            "directory above the shared-memory tree must be writable by its owner only, or sticky as "
            "/dev/shm is)",
        )
