"""Run a command inside a node's network namespace, as ``ip netns exec`` does:
``python -m hyperpod_sim.infra.netns_exec <namespace> -- CMD [ARGS...]``.

It enters the namespace (setns on /run/netns/<namespace>), unshares a mount namespace of its own
(mounts propagate from the host into it, never back), mounts each file of /etc/netns/<namespace>/
over its namesake in /etc (the node's hosts file: HyperPod's daemon service name at the node's
address, hyperpod_sim/infra/netns.py), mounts a sysfs of the namespace over /sys, and then execs
CMD: the pid stays the same, so whoever started this trampoline holds CMD's process. Standard
library only (``node exec`` runs it from an SDK-only install); root or CAP_SYS_ADMIN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 0x2
RUN_DIRS = (Path("/run/netns"), Path("/var/run/netns"))
ETC_DIR = Path("/etc/netns")


def trampoline_argv(namespace: str, argv: Sequence[str], *, python: str | None = None) -> list[str]:
    """The command line that runs ``argv`` inside ``namespace``."""
    return [python or sys.executable, "-m", "hyperpod_sim.infra.netns_exec", namespace, "--", *argv]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def enter(namespace: str) -> None:
    """Move this process into ``namespace``'s network and a mount namespace of its own with the
    namespace's /etc files mounted. OSError when it cannot (no such namespace, not privileged)."""
    path = next((d / namespace for d in RUN_DIRS if (d / namespace).exists()), None)
    if path is None:
        raise FileNotFoundError(2, f"no network namespace {namespace!r} (under /run/netns)")
    libc = _libc()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "making / a slave mount")
    etc = ETC_DIR / namespace
    if etc.is_dir():
        for entry in sorted(etc.iterdir()):
            target = Path("/etc") / entry.name
            if entry.is_file() and target.exists():
                _check(
                    libc.mount(os.fsencode(entry), os.fsencode(target), None, MS_BIND, None),
                    f"mounting {entry} over {target}",
                )
    # /sys/class/net of the namespace, as `ip netns exec` shows it; a system that refuses keeps the host's.
    if libc.umount2(b"/sys", MNT_DETACH) == 0:
        libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m hyperpod_sim.infra.netns_exec NAMESPACE -- CMD [ARGS...]", file=sys.stderr)
        return 2
    namespace, command = args[0], args[2:]
    try:
        enter(namespace)
    except OSError as exc:
        print(f"hyperpod-sim: cannot enter the node's network namespace {namespace}: {exc}", file=sys.stderr)
        return 126
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"hyperpod-sim: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
