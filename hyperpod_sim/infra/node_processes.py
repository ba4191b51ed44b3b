"""What runs on a node besides its agent: the commands ``node exec`` (and a job's ranks) start.

A process belongs to a node when its environment holds ``HPSIM_ON_NODE=<node id>`` (ON_NODE):
``node exec`` sets it, and a process's children inherit it, as everything started on a machine
stays on that machine. When the node goes as a machine goes (NodeLoss, a reboot, its deletion,
scale-down), :func:`end_node_processes` ends every process marked with its id, with SIGKILL.

Why a mark in the environment and not a registry of pids: a process cannot set another's
environment, only its own and its children's, so a mark can only make serve end processes of the
user who set it (the worst it can do is have one's own command ended), while a pid handed to serve
could name anything. A process that clears its environment (``env -i``) and detaches leaves its
node: documented in docs/nodes.md. The kill goes through a pidfd opened before the environment is
read, so a pid the kernel reuses meanwhile is never signalled.

The scan of /proc costs one read per process on the machine; it runs only for nodes that ever had
a command started (the provisioner's ``sessions`` mark in the node's agent dir).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Collection

ON_NODE = "HPSIM_ON_NODE"


def _environ_mark(pid: int, name: str = ON_NODE) -> str | None:
    """The value of variable ``name`` in process ``pid``'s environment (as it was at its exec)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd reads as ready)."""
    ready, _, _ = select.select([pidfd], [], [], 0)
    return bool(ready)


def marked_processes(values: Collection[str], *, name: str = ON_NODE) -> dict[int, str]:
    """The processes on this machine whose variable ``name`` is one of ``values``: pid -> value."""
    wanted = set(values)
    found: dict[int, str] = {}
    if not wanted:
        return found
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            value = _environ_mark(int(entry.name), name)
            if value in wanted:
                found[int(entry.name)] = value
    return found


def node_processes(node_ids: Collection[str]) -> dict[int, str]:
    """The processes on this machine marked as running on one of ``node_ids``: pid -> node id."""
    return marked_processes(node_ids)


def end_node_processes(node_ids: Collection[str]) -> list[int]:
    """SIGKILL every process marked as running on one of ``node_ids`` (never this one); the pids
    signalled."""
    return end_marked(node_ids)


def end_marked(values: Collection[str], *, name: str = ON_NODE) -> list[int]:
    """SIGKILL every process whose variable ``name`` is one of ``values`` (never this one); the
    pids signalled."""
    wanted = set(values)
    ended: list[int] = []
    for pid in marked_processes(wanted, name=name):
        if pid == os.getpid():
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        try:
            # Read again through the pidfd's process: the pid may have been reused since the scan.
            if _environ_mark(pid, name) in wanted and not _exited(pidfd):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    ended.append(pid)
        finally:
            os.close(pidfd)
    return ended
