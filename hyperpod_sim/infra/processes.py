"""Processes on this machine: starting an agent (or SeaweedFS) in a session of its own, its
pidfile, signals to its process group, whether it still runs, its parent and command line, and its
shared memory.

A running agent is known by its pid and the start time the kernel gives it (field 22 of
``/proc/<pid>/stat``), so that a pid the kernel gave to another process since is not taken for the
agent. Both are in the agent's pidfile, which outlives the control plane that wrote it: the next one
adopts the agents it finds there (hyperpod_sim/infra/local.py).

``agent_processes`` and ``find_agent_pids`` scan every process's command line; they are for
observers (the tests, bench/), not for the provisioner, which knows its agents by handle and
pidfile.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperpod_sim.contracts.processes import process_stat as _stat
from hyperpod_sim.contracts.processes import start_time as start_time

PIDFILE = "agent.pid"


@dataclass(frozen=True)
class Pidfile:
    """What a control plane wrote when it started an agent (``<agent dir>/agent.pid``)."""

    pid: int
    start_time: int  # the kernel's start time of the process, in clock ticks since boot
    node_id: str
    control_plane: str  # the address the agent calls

    def write(self, agent_dir: Path) -> None:
        """Write it atomically (a reader sees the old file or the new one, never half of one)."""
        path = agent_dir / PIDFILE
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.__dict__))
        partial.replace(path)

    @classmethod
    def read(cls, agent_dir: Path) -> Pidfile | None:
        """The agent dir's pidfile, or None if it has none (or one it cannot read)."""
        try:
            doc = json.loads((agent_dir / PIDFILE).read_text())
            return cls(
                pid=int(doc["pid"]),
                start_time=int(doc["start_time"]),
                node_id=str(doc["node_id"]),
                control_plane=str(doc["control_plane"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def remove(agent_dir: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            (agent_dir / PIDFILE).unlink()

    def alive(self) -> bool:
        """Whether the process it names still runs (and is the one it names)."""
        return start_time(self.pid) == self.start_time


def parent_pid(pid: int) -> int | None:
    """The pid of process ``pid``'s parent; None if there is no such process."""
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


def command_line(pid: int) -> list[str] | None:
    """Process ``pid``'s arguments (none for a zombie); None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


# What every child of the control plane may inherit from its environment: how to run a program and
# where its temporary files and locale are. Nothing else passes unless the child's own allow-list
# names it (infra/local.py's agents, serve/seaweedfs.py's weed): serve's environment holds its secrets
# (HPSIM_AUTH__*, a database URL with its password), and no child needs them (docs/security.md).
BASE_ENV_NAMES = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TMPDIR", "TZ", "LD_LIBRARY_PATH"})
BASE_ENV_PREFIXES = ("LC_",)


def inherited_environment(
    environ: Mapping[str, str], *, names: Collection[str] = (), prefixes: Sequence[str] = ()
) -> dict[str, str]:
    """The variables of ``environ`` a child gets: BASE_ENV_NAMES and ``names``, and those that
    start with one of BASE_ENV_PREFIXES or ``prefixes``; no other."""
    allowed = BASE_ENV_NAMES | frozenset(names)
    starts = (*BASE_ENV_PREFIXES, *prefixes)
    return {key: value for key, value in environ.items() if key in allowed or key.startswith(starts)}


def spawn(
    argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (in ``cwd``, else this process's working dir) in a session (and process
    group) of its own, its output appended to ``log_path``: the SIGINT of a Ctrl+C in the control
    plane's terminal reaches the control plane's process group only. May raise OSError."""
    with open(log_path, "ab") as logfile:
        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def signal_group(pid: int, signum: int) -> bool:
    """Send ``signum`` to the process group that ``pid`` leads (an agent and whatever it runs);
    whether there was one."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):  # not a group leader: the process alone
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
    return True


def wipe_shared_memory(directory: Path) -> None:
    """Remove a node's shared-memory directory (its shards are gone with it)."""
    shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------- observers' scans of /proc


@dataclass(frozen=True)
class AgentProcess:
    """An agent process on this machine, as its command line describes it."""

    pid: int
    node_id: str
    control_plane: str | None
    data_dir: Path | None


def command_lines() -> dict[int, list[bytes]]:
    """Every process's command line, split into its arguments (one pass over /proc); a zombie
    has none, so is not listed."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if argv != [b""]:
            found[int(entry.name)] = argv
    return found


def _flag(argv: list[bytes], name: bytes) -> str | None:
    index = argv.index(name) + 1 if name in argv else len(argv)
    return argv[index].decode(errors="replace") if index < len(argv) else None


def agent_processes() -> list[AgentProcess]:
    """Every agent process on this machine with a node id: a command line with an argument
    ending in ``agent`` and ``--node-id``."""
    found = []
    for pid, argv in command_lines().items():
        node_id = _flag(argv, b"--node-id")
        if node_id is None or not any(arg.endswith(b"agent") for arg in argv):
            continue
        data_dir = _flag(argv, b"--data-dir")
        found.append(
            AgentProcess(
                pid=pid,
                node_id=node_id,
                control_plane=_flag(argv, b"--control-plane"),
                data_dir=Path(data_dir) if data_dir is not None else None,
            )
        )
    return found


def find_agent_pids(node_id: str) -> list[int]:
    """Processes on this machine running the agent of ``node_id`` (by their command line)."""
    return [agent.pid for agent in agent_processes() if agent.node_id == node_id]


def pids_mentioning(path: Path, argument: str) -> list[int]:
    """Processes (not this one) whose command line contains ``path`` anywhere and ``argument`` as
    the end of an argument (e.g. ``agent``: ``hyperpod-sim agent --data-dir <path>/...``)."""
    marker = str(path).encode()
    wanted = argument.encode()
    return [
        pid
        for pid, argv in command_lines().items()
        if pid != os.getpid() and any(arg.endswith(wanted) for arg in argv) and marker in b"\0".join(argv)
    ]
