"""How a forked agent shows itself in ``/proc/<pid>/cmdline`` and ``environ``: those files show
the areas of memory where the kernel laid out argv and the environment at exec, which a forked
child inherits from the launcher. The child writes its own over them, so that what finds agents by
their command line (the provisioner's scan at start, the tests, bench/) finds it, and its
environment reads as an exec'ed agent's would."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence


class TitleError(ValueError):
    """An argv that does not fit in the launcher's room."""


class Title:
    """The areas of this process's memory that ``/proc/<pid>/cmdline`` and ``environ`` show: the
    argv and environment strings the kernel laid out at exec (``/proc/self/stat`` fields 48-51).
    A forked child writes its own there, as NUL-separated strings, the rest NUL; the launcher was
    started with room to spare in both (a padding argument and ``ROOM_VARIABLE``)."""

    def __init__(self) -> None:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        # Fields 48..51 of stat, counted from 1 with the pid and the name first.
        self.arg_start, self.arg_end, self.env_start, self.env_end = (int(f) for f in fields[45:49])

    @property
    def argv_room(self) -> int:
        return self.arg_end - self.arg_start

    @staticmethod
    def _pack(items: Sequence[str], room: int) -> bytes | None:
        packed = b"".join(item.encode(errors="surrogateescape") + b"\0" for item in items)
        return packed + b"\0" * (room - len(packed)) if len(packed) <= room else None

    def fits(self, argv: Sequence[str]) -> bool:
        return self._pack(argv, self.argv_room) is not None

    def write(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Show ``argv`` (and ``env``: the entries that fit) as this process's. Before the
        environment area is written, libc must hold no pointer into it: ``replace_environment``."""
        packed = self._pack(argv, self.argv_room)
        if packed is None:
            raise TitleError(f"argv: {len(argv)} arguments do not fit in {self.argv_room} bytes")
        ctypes.memmove(self.arg_start, packed, len(packed))
        if env is not None:
            room = self.env_end - self.env_start
            entries, used = [], 0
            for key, value in env.items():
                entry = f"{key}={value}"
                size = len(entry.encode(errors="surrogateescape")) + 1
                if used + size <= room:
                    entries.append(entry)
                    used += size
            packed_env = self._pack(entries, room)
            assert packed_env is not None
            ctypes.memmove(self.env_start, packed_env, len(packed_env))


def replace_environment(env: dict[str, str]) -> None:
    """This process's environment becomes ``env`` and no other: libc's too (``clearenv`` drops
    its pointers into the area the kernel laid out; ``setenv`` copies each new value)."""
    os.environ.clear()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.clearenv()
    os.environ.update(env)
