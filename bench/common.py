"""Helpers shared by the benchmark scripts in ``bench/``.

The scripts run as ``python bench/<name>.py`` from the repository root (each puts the root on
``sys.path`` before importing this module) or as ``python -m bench.<name>``.

What is here is what the scripts did alike, one copy each:

* processes: a free loopback port, a process's CPU time and memory from ``/proc``, the processes
  whose command line mentions a path (and stopping them), stopping a subprocess, polling with a
  deadline, SIGTERM unwinding like Ctrl-C;
* servers: ``hyperpod-sim serve`` (or any command) as a subprocess on a free port with its output
  in a log file, waiting until it answers;
* AWS JSON 1.1 over raw HTTP: a boto3 SageMaker client for setup, a ``before-send`` hook that
  records the exact request botocore puts on the wire, and a lean keep-alive ``http.client``
  connection that replays it;
* reports: formatting, the table header and rule, the notes, the JSON file and its
  ``target_ratios`` entries.

Nothing here measures anything by itself; what a script measures, prints and writes stays in it.
Linux only where ``/proc`` is read (the readers say what they return elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from hyperpod_sim.infra.processes import pids_mentioning

HOST = "127.0.0.1"
REGION = "us-east-1"
MIB = 1024 * 1024
HPSIM = "hyperpod-sim"

T = TypeVar("T")

# ---------------------------------------------------------------------- processes


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# Indexes into proc_stat's fields (proc(5) numbers them from 1, with the pid and command as 1 and 2).
STAT_STATE, STAT_MINFLT, STAT_UTIME, STAT_STIME = 0, 7, 11, 12


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command (fields[0] is field 3, the state);
    None when the process is gone or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (None when it is gone or there is no /proc)."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    return (int(fields[STAT_UTIME]) + int(fields[STAT_STIME])) / os.sysconf("SC_CLK_TCK")


MEMORY_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory_status(pid: int, fields: Sequence[str] = MEMORY_FIELDS) -> dict[str, int]:
    """The given ``/proc/<pid>/status`` fields (kB there), in bytes; empty when the process is gone
    (or a field does not parse)."""
    found: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in fields:
                found[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return {}
    return found


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process in bytes (None when it is gone)."""
    return memory_status(pid, ("VmRSS",)).get("VmRSS")


def terminate_pids(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM (and SIGCONT, should one be stopped) each process, wait up to ``grace_s`` for all to
    exit, then SIGKILL those left."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def agent_pids_under(workdir: Path) -> list[int]:
    """``hyperpod-sim agent`` processes whose command line mentions ``workdir`` (the local
    provisioner puts their --data-dir inside the server's data dir, so inside ``workdir``)."""
    return pids_mentioning(workdir, "agent")


def kill_leftover_agents(workdir: Path, grace_s: float = 5.0) -> int:
    """Stop the agent processes this run's servers started under ``workdir`` (SIGTERM, then
    SIGKILL); how many there were."""
    pids = agent_pids_under(workdir)
    terminate_pids(pids, grace_s)
    return len(pids)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Terminate a subprocess if it still runs, wait up to ``timeout``, then kill it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def poll(
    check: Callable[[], T | None],
    deadline_s: float,
    interval_s: float,
    on_timeout: Callable[[], BaseException],
) -> T:
    """Call ``check`` until it returns something other than None, and return that.

    After each unfinished check: past ``deadline_s`` (monotonic, from this call) raise what
    ``on_timeout()`` returns (it may raise something of its own instead, e.g. "the server
    exited"), else sleep ``interval_s``. ``check`` may raise to give up early.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise on_timeout()
        time.sleep(interval_s)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Make SIGTERM (a timeout wrapper, a CI cancel) unwind like Ctrl-C, so that ``finally``
    blocks stop the servers and agents."""
    signal.signal(signal.SIGTERM, _raise_exit)


def progress(text: str) -> None:
    """A progress line on stderr (stdout carries only the report)."""
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- servers


@dataclass
class Server:
    """A server subprocess on ``HOST:port``, its output in ``log_path``."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raise RuntimeError (with the log's tail) if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def spawn(name: str, cmd: list[str], env: Mapping[str, str], log_path: Path, port: int) -> Server:
    """Start ``cmd`` (which is to listen on ``port``) with stdout and stderr into ``log_path``."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; `finally` stops the servers.
        )
    return Server(name=name, port=port, proc=proc, log_path=log_path)


def hpsim_command() -> list[str]:
    """How to run the ``hyperpod-sim`` CLI: the script next to this Python, else on PATH, else
    ``python -m hyperpod_sim``."""
    script = Path(sys.executable).parent / "hyperpod-sim"
    if script.exists():
        return [str(script)]
    found = shutil.which("hyperpod-sim")
    return [found] if found else [sys.executable, "-m", "hyperpod_sim"]


def start_hpsim(workdir: Path, settings: Mapping[str, str], name: str = HPSIM) -> Server:
    """``hyperpod-sim serve`` on a free port, data dir ``workdir/hpsim-data`` (a fresh SQLite
    database when ``workdir`` is new), log ``workdir/hpsim.log``, log level warning (no access
    log); ``settings`` (``HPSIM_...`` variables) are added to this process's environment. Its
    embedded S3 (unless an endpoint or port is set) gets a free block of ports."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    env.update(settings)
    if "HPSIM_S3__ENDPOINT_URL" not in env and "HPSIM_S3__EMBEDDED_PORT" not in env:
        # serve embeds an S3 server on fixed default ports: another serve on this machine (a test
        # run, a second script) would hold them.
        from hyperpod_sim.serve.seaweedfs import free_embedded_port

        env["HPSIM_S3__EMBEDDED_PORT"] = str(free_embedded_port())
    cmd = [
        *hpsim_command(),
        "serve",
        *("--host", HOST),
        *("--port", str(port)),
        *("--data-dir", str(workdir / "hpsim-data")),
        *("--log-level", "warning"),
    ]
    return spawn(name, cmd, env, workdir / "hpsim.log", port)


def wait_ready(server: Server, deadline_s: float, path: str | None = "/health") -> None:
    """Poll ``GET path`` until it answers 200 (without a path: until a TCP connect succeeds), every
    0.1 s, within ``deadline_s``; raise at once if the server exits."""
    last_error = "no attempt"
    where = server.endpoint if path is None else f"{server.endpoint}{path}"

    def ready() -> bool | None:
        nonlocal last_error
        server.check_alive()
        try:
            if path is None:
                with socket.create_connection((HOST, server.port), timeout=2):
                    return True
            with urllib.request.urlopen(f"{server.endpoint}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return True
                last_error = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"HTTP {exc.code}"
        except (OSError, urllib.error.URLError) as exc:
            last_error = repr(exc)
        return None

    def timed_out() -> TimeoutError:
        return TimeoutError(
            f"{server.name} not ready at {where} within {deadline_s}s ({last_error}); "
            f"log tail:\n{server.log_tail()}"
        )

    poll(ready, deadline_s, 0.1, timed_out)


def stop_servers(servers: Sequence[Server]) -> None:
    """Stop the servers, the last started first; a failure is a warning on stderr, not an error."""
    for server in reversed(servers):
        try:
            server.stop()
        except Exception as exc:
            print(f"warning: could not stop {server.name}: {exc!r}", file=sys.stderr)


def http_json(url: str, timeout: float = 10.0) -> Any:
    """``GET url``, the JSON it answers."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection mid-message")
        got += n


# ---------------------------------------------------------------------- AWS JSON 1.1: boto3 and raw HTTP


def sagemaker_client(
    endpoint: str,
    *,
    read_timeout: float,
    connect_timeout: float | None = None,
    max_pool_connections: int | None = None,
) -> Any:
    """A boto3 SageMaker client for ``endpoint`` (dummy credentials, one attempt per call, no
    retries); ``connect_timeout`` and ``max_pool_connections`` left out keep botocore's defaults."""
    import boto3  # here: the scripts' helper processes never need boto3
    from botocore.config import Config

    options: dict[str, Any] = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
    if connect_timeout is not None:
        options["connect_timeout"] = connect_timeout
    options["read_timeout"] = read_timeout
    if max_pool_connections is not None:
        options["max_pool_connections"] = max_pool_connections
    return boto3.session.Session().client(
        "sagemaker",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="x",
        aws_secret_access_key="y",
        config=Config(**options),
    )


@dataclass(frozen=True)
class WireRequest:
    """One request exactly as botocore sent it: headers in order (without Host, Accept-Encoding and
    Content-Length, which ``http.client`` adds the same way urllib3 does) and the JSON body."""

    operation: str
    headers: tuple[tuple[str, str], ...]
    body: bytes


_ADDED_BY_HTTP_CLIENT = ("host", "accept-encoding", "content-length")


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


class WireRecorder:
    """Records every SageMaker request a boto3 client sends (or only ``operation``'s), keyed by
    operation name (the last one of each), with a ``before-send`` hook; ``stop`` removes it."""

    def __init__(self, client: Any, operation: str | None = None) -> None:
        self.captured: dict[str, WireRequest] = {}
        self._client = client
        self._event = "before-send.sagemaker" + ("" if operation is None else f".{operation}")
        self._handler = self._record  # one object, so that unregister finds what register got
        client.meta.events.register(self._event, self._handler)

    def _record(self, request: Any, **_: Any) -> None:
        headers = tuple(
            (_text(k), _text(v)) for k, v in request.headers.items() if k.lower() not in _ADDED_BY_HTTP_CLIENT
        )
        target = dict(headers).get("X-Amz-Target", "")
        operation = target.rpartition(".")[2]
        body = request.body if isinstance(request.body, bytes) else _text(request.body or b"").encode()
        self.captured[operation] = WireRequest(operation=operation, headers=headers, body=body)

    def stop(self) -> None:
        self._client.meta.events.unregister(self._event, self._handler)


class RawClient:
    """A lean keep-alive client: one ``http.client.HTTPConnection`` replaying a recorded request
    (``POST /``, the recorded headers, a JSON body). No retries: after an error, ``close`` it and
    the next ``send`` reconnects."""

    def __init__(self, port: int, wire: WireRequest, timeout: float = 30.0) -> None:
        self.conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
        self.headers = wire.headers
        self.template: dict[str, Any] = json.loads(wire.body)

    def body(self, cluster_name: str | None = None) -> bytes:
        """The recorded body, with ``ClusterName`` replaced when given (json.dumps, like botocore)."""
        params = self.template
        if cluster_name is not None:
            params = {**params, "ClusterName": cluster_name}
        return json.dumps(params).encode()

    def send(self, body: bytes) -> tuple[int, bytes]:
        """One request; the status and the whole response body."""
        conn = self.conn
        conn.putrequest("POST", "/")  # adds Host and Accept-Encoding: identity, as urllib3 does
        for name, value in self.headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, data

    def close(self) -> None:
        self.conn.close()


# ---------------------------------------------------------------------- arguments and reports


def parse_ints(text: str) -> list[int]:
    """The distinct integers of a comma-separated list, sorted (blank items skipped); ValueError
    on anything else."""
    return sorted({int(item) for item in text.split(",") if item.strip()})


def int_list_option(parser: argparse.ArgumentParser, option: str, text: str, unit: str = "") -> list[int]:
    """``parse_ints(text)``, or exit through ``parser.error``: "<option> must list positive
    integers<unit>, got '<text>'". The range checks stay with the caller."""
    try:
        return parse_ints(text)
    except ValueError:
        parser.error(f"{option} must list positive integers{unit}, got {text!r}")


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or ``-`` for None and NaN."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(header: str, rows: Iterable[str] = ()) -> list[str]:
    """A table's lines: the header, a rule of dashes as wide as it, the rows."""
    return [header, "-" * len(header), *rows]


def with_notes(lines: Iterable[str], notes: Iterable[str]) -> str:
    """The report: ``lines``, a blank line, then one ``note: ...`` line per note."""
    return "\n".join([*lines, "", *(f"note: {n}" for n in notes)])


def write_json(path: Path, payload: Any) -> None:
    """``payload`` as indented JSON, with a final newline."""
    path.write_text(json.dumps(payload, indent=2) + "\n")


def ratio_vs_target(name: str, value: float | None, target: str, met: bool) -> dict[str, Any]:
    """One entry of the ``target_ratios`` member that every script's JSON has, beside its own
    members (``bench/run_all.py`` builds its table from them): what is compared, the measured ratio
    (rounded; None when it could not be computed), the target as the script prints it
    (``">= 2x"``) and whether the ratio meets it. Ratios without a target stay out of it."""
    if value is not None and not math.isfinite(value):
        value = None
    return {"name": name, "value": None if value is None else round(value, 3), "target": target, "met": met}
