"""A process on this machine, as the kernel tells it: its start time, which with its pid names
it for good (a pid the kernel reuses has another start time). Shared by the control plane (its
agents' pidfiles, hyperpod_sim/infra/processes.py) and the job supervisor, which reports its own
(hyperpod_sim/cli/jobs.py)."""

from __future__ import annotations

__all__ = ["process_stat", "start_time"]


def process_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state, field 3, first);
    None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything, spaces included.
    return stat[stat.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The kernel's start time of process ``pid``; None if there is none, or only its zombie."""
    fields = process_stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):  # exited, not yet collected
        return None
    return int(fields[19])
