"""How ``hyperpod-sim serve`` holds its data dir and stops: one control plane per data dir (and per
SQLite file), and a graceful stop that leaves no agent process behind.

- **The lock.** ``serve`` takes an exclusive ``flock`` on ``<data dir>/serve.lock`` and, on SQLite,
  on ``<database file>.lock``, and writes its pid into each. A second ``serve`` on either refuses
  to start and names the first one's pid. The kernel drops the lock with the process, however it
  ends (SIGKILL included), so a stale lock file never blocks a start. Two control planes may still
  share one PostgreSQL database, each with its own data dir.
- **The shared-memory root.** In local mode ``serve`` makes ``HPSIM_SIMULATION__SHM_ROOT``
  (``/dev/shm/hpsim``) its user's only (0700) before anything starts, and refuses to start if it
  exists as another user's or writable by others (contracts/shm.py): whoever makes it first
  would own every node's checkpoints.
- **The stop.** SIGINT (Ctrl+C, which the terminal sends to the whole process group) and SIGTERM
  (to the server's pid) both stop it gracefully: the reconciler stops, then every agent it runs is
  told to stop (SIGTERM) and waited for, while the API still answers (a draining agent may call
  it) and before the embedded S3 endpoint stops (the agents drain their newest complete step to
  it). Agents run in sessions of their own (hyperpod_sim/infra/local.py), so the Ctrl+C reaches only
  this process; a second Ctrl+C kills the agents still draining. Shared memory is kept: the next
  ``serve`` starts the agents again on the same nodes, and they find their shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import resource
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from sqlalchemy.engine import make_url

from hyperpod_sim.contracts.agent_api import SERVER_KEEPALIVE_S
from hyperpod_sim.contracts.shm import private_directory
from hyperpod_sim.settings import Settings


class AlreadyServing(Exception):
    """Another control plane holds the data dir or the SQLite file."""


class PortUnavailable(Exception):
    """The address ``serve`` was to listen on is taken, or not this machine's."""


@contextlib.contextmanager
def bind(host: str, port: int) -> Iterator[socket.socket]:
    """The listening socket, bound before anything starts or is announced: a busy port is one
    line, and the banner that follows is true. uvicorn serves on it (:func:`run`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                problem = "is in use (another serve?); choose another with --port or HPSIM_PORT"
            else:
                problem = f"cannot be listened on: {exc.strerror or exc}"
            raise PortUnavailable(f"{host}:{port} {problem}") from None
        listener.listen(2048)
        yield listener
    finally:
        listener.close()


def prepare_shm_root(settings: Settings) -> None:
    """In local mode, make the shared-memory root this user's only; UnsafeDirectory if another
    user could change it (contracts/shm.py)."""
    if settings.provisioning.mode == "local":
        private_directory(settings.simulation.shm_root)


def lock_paths(settings: Settings) -> list[tuple[Path, str]]:
    """The lock files ``serve`` holds, each with what it protects (for the refusal's message)."""
    data_dir = settings.data_dir.resolve()
    paths = [(data_dir / "serve.lock", f"data dir {data_dir}")]
    url = make_url(settings.database_url())
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        database = Path(url.database).resolve()
        paths.append((database.with_name(database.name + ".lock"), f"SQLite database {database}"))
    return paths


@contextlib.contextmanager
def hold_lock(settings: Settings) -> Iterator[None]:
    """Hold every lock of :func:`lock_paths` for the block; AlreadyServing if another holds one."""
    with contextlib.ExitStack() as stack:
        for path, what in lock_paths(settings):
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = stack.enter_context(open(path, "a+"))  # closed by the stack
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise AlreadyServing(
                    f"another control plane (pid {holder}) is serving {what} (lock {path}); stop it "
                    "first, or give this one its own --data-dir (and, on SQLite, --database-url)"
                ) from None
            handle.truncate(0)
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        yield


class ControlPlaneServer(uvicorn.Server):
    """uvicorn, with the control plane's agents stopped before the listener closes."""

    def __init__(self, config: uvicorn.Config, app: Any, *, early: StopSignals) -> None:
        super().__init__(config)
        self._app = app
        self._hurry = threading.Event()
        self._early = early

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # A SIGINT or SIGTERM that came before uvicorn listened for them (while the embedded S3
        # started, or the app was built) stops this server now, gracefully, instead of being lost.
        for sig in self._early.take():
            self.handle_exit(sig, None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second Ctrl+C: kill the agents that are still draining
            self._hurry.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        services = getattr(self._app.state, "services", None)
        if services is not None:
            # In a thread: the event loop goes on serving the agents' calls while they drain. The
            # lifespan's own stop then finds nothing left to do.
            await asyncio.to_thread(services.reconciler.stop, hurry=self._hurry)
        await super().shutdown(sockets)


class StopSignals:
    """SIGINT and SIGTERM from the start of ``serve`` until uvicorn takes them over: recorded, so a
    stop asked for while the embedded S3 starts or the app is built is neither lost (uvicorn
    would then serve on, deaf to it) nor a kill that skips the agents' drain. uvicorn replays the
    signal it handled once it returns; here that is recorded too, and ignored."""

    def __init__(self) -> None:
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.signal(sig, self._record) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, sig: int, frame: FrameType | None) -> None:
        self._pending.append(sig)

    @property
    def stop_asked(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[int]:
        taken, self._pending = self._pending, []
        return taken


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one: every agent keeps a connection to serve
    (``SERVER_KEEPALIVE_S``), and a 1,024-node cluster's would not fit under a soft limit of 1,024,
    the default of many systems."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit cannot be a soft one for open files (the kernel's nr_open bounds it).
    if resource.RLIM_INFINITY not in (soft, hard) and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(
    app: Any,
    *,
    listener: socket.socket,
    log_level: str,
    early: StopSignals,
    extra: Sequence[socket.socket] = (),
) -> None:
    """Serve ``app`` on ``listener`` (:func:`bind`) and the ``extra`` listeners (the bridge's
    gateway on the namespaces node network, serve/node_network.py) until SIGINT or SIGTERM, then
    stop gracefully (see the module's docstring). ``early``: the signals recorded since serve
    started (in force around this call), replayed once uvicorn is up."""
    host, port = listener.getsockname()[:2]
    raise_open_files_limit()
    server = ControlPlaneServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_keep_alive=int(SERVER_KEEPALIVE_S),
        ),
        app,
        early=early,
    )
    server.run(sockets=[listener, *extra])
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the start failed (uvicorn logged why)
