"""The agent launcher: a fork server that starts node agents for the local provisioner.

An agent started with ``exec`` is a fresh interpreter that imports everything again (about 30 MiB
of private memory each). The launcher imports the agent's modules once, freezes what it holds
(``gc.freeze``: the collector then never writes to those objects, so their pages stay shared), and
forks one child per request; each child shares those pages copy-on-write with the launcher and
its siblings.

Each child is what ``spawn`` would have started (hyperpod_sim/infra/processes.py): a session and
process group of its own, stdin from /dev/null, stdout and stderr appended to the node's log, the
environment it is given and no other, and ``/proc/<pid>/cmdline`` and ``environ`` showing its own
argv and environment (written over the launcher's, see ``Title``), so that the observers that find
agents by their command line find it. It runs the agent's entry and exits with its status.

The launcher answers on a Unix socket in a directory only its user may enter (0700, checked at
start), to a peer of its own uid only (SO_PEERCRED); a request is one JSON document, bounded in
size (``MAX_REQUEST``), never code or pickle: ``{"argv": [str], "env": {str: str}, "log": str}``,
answered ``{"pid": int}`` or ``{"error": str}``. A refused request starts nothing. It collects its
exited children, and exits when its parent (serve) is gone; its agents live on, as exec'ed ones
do, and the next serve adopts them by their pidfiles.

What stays private to each child after the fork is mostly pages of the launcher's Python objects
that the child only touched: CPython writes an object's reference count whenever it uses it, so the
kernel copies the page, although the count is back where it was a moment later (measured: about
12 MiB of each agent's 13, with no new allocation behind them). Those copies are alike from one
agent to the next, so the launcher marks its memory mergeable by the kernel's same-page merging
(``mark_mergeable``; its children inherit the mark), and where the machine's ksmd runs, it keeps
one copy of each such page for all agents.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hyperpod_sim.agents.launcher.title import Title, TitleError, replace_environment

MAX_REQUEST = 64 * 1024  # bytes of one request
MAX_ARGS = 128
MAX_ENV = 256
REQUEST_TIMEOUT_S = 5.0  # for a peer to send its request: a silent one cannot hold the launcher
PARENT_CHECK_S = 0.5
ROOM_VARIABLE = "HPSIM_LAUNCHER_ROOM"  # padding in the launcher's environment: room for a child's
PR_SET_MEMORY_MERGE = 67  # linux/prctl.h (Linux 6.4): every anonymous page of the process mergeable
KSM_RUN = Path("/sys/kernel/mm/ksm/run")  # 1 while ksmd merges

Entry = Callable[[list[str]], int]


class RequestError(ValueError):
    """A request the launcher refuses: its answer's error."""


@dataclass(frozen=True)
class LaunchRequest:
    argv: list[str]
    env: dict[str, str]
    log: Path

    @classmethod
    def parse(cls, raw: bytes) -> LaunchRequest:
        """The request in ``raw``, checked: RequestError says what is wrong."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"not a JSON document: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != {"argv", "env", "log"}:
            raise RequestError('expected an object with exactly "argv", "env" and "log"')
        argv, env, log = doc["argv"], doc["env"], doc["log"]
        if not isinstance(argv, list) or not 0 < len(argv) <= MAX_ARGS:
            raise RequestError(f"argv: a list of 1 to {MAX_ARGS} strings")
        if not all(isinstance(arg, str) and "\0" not in arg for arg in argv):
            raise RequestError("argv: strings without NUL")
        if not isinstance(env, dict) or len(env) > MAX_ENV:
            raise RequestError(f"env: an object of at most {MAX_ENV} strings")
        for key, value in env.items():
            if not key or "=" in key or "\0" in key or not isinstance(value, str) or "\0" in value:
                raise RequestError(f"env: {key!r} is not a variable name with a string value")
        if not isinstance(log, str) or not os.path.isabs(log) or "\0" in log:
            raise RequestError("log: an absolute path")
        return cls(argv=list(argv), env=dict(env), log=Path(log))


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address of the Unix socket ``path`` short enough for ``bind`` and ``connect`` (108 bytes
    at most) however deep its directory: the name through an open descriptor of the directory
    (``/proc/self/fd/N/name``). A data dir under pytest's or a user's long path would not fit."""
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def check_private_directory(directory: Path) -> None:
    """Refuse (OSError) a socket directory that is a link, not this user's, or open to others."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{directory}: the launcher's directory must be a directory of uid {os.getuid()} "
            f"with mode 0700 (it is {stat.filemode(info.st_mode)}, uid {info.st_uid})"
        )


@dataclass
class Launcher:
    """The fork server: ``serve`` answers requests on ``socket_path`` until the process whose pid
    is ``parent`` is no longer this one's parent."""

    socket_path: Path
    parent: int
    entry: Entry  # runs the agent: the argv after the agent command's interpreter and module
    agent_command: Sequence[str]  # what every request's argv starts with

    def __post_init__(self) -> None:
        self._title = Title()
        self._children: set[int] = set()
        self._stop = False
        self._selector: selectors.BaseSelector | None = None

    def serve(self) -> int:
        check_private_directory(self.socket_path.parent)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        # Bound and listening under another name first: once the socket has its name, it answers.
        partial = self.socket_path.with_name(f".{self.socket_path.name}.{os.getpid()}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)
        try:
            with unix_address(partial) as address:
                listener.bind(address)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        os.replace(partial, self.socket_path)
        listener.setblocking(False)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        # Everything imported so far is shared with the children: the collector leaves it alone.
        gc.collect()
        gc.freeze()
        _say(f"agent launcher on {self.socket_path} (pid {os.getpid()}, parent {self.parent})")
        selector = self._selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        try:
            while not self._stop and os.getppid() == self.parent:
                if selector.select(timeout=PARENT_CHECK_S):
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        conn, _ = listener.accept()
                        with conn:
                            self._answer(conn, listener)
                self._collect()
        finally:
            selector.close()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        _say("agent launcher stopping: its agents live on")
        return 0

    def _on_term(self, signum: int, frame: object) -> None:
        self._stop = True

    def _collect(self) -> None:
        """Collect exited children, so that none stays a zombie."""
        while self._children:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self._children.clear()
                return
            if pid == 0:
                return
            self._children.discard(pid)

    def _answer(self, conn: socket.socket, listener: socket.socket) -> None:
        conn.setblocking(True)
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            if _peer_uid(conn) != os.getuid():
                answer: dict[str, object] = {"error": "refused: the launcher serves its own user only"}
            else:
                answer = self._launch(_read_request(conn), conn, listener)
        except (RequestError, TitleError) as exc:
            answer = {"error": str(exc)}
        except OSError as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(answer).encode() + b"\n")

    def _launch(self, raw: bytes, conn: socket.socket, listener: socket.socket) -> dict[str, object]:
        request = LaunchRequest.parse(raw)
        prefix = list(self.agent_command)
        if request.argv[: len(prefix)] != prefix:
            raise RequestError(f"argv: must start with the agent command {prefix}")
        if not self._title.fits(request.argv):
            raise RequestError(f"argv: longer than the launcher's room ({self._title.argv_room} bytes)")
        log_fd = os.open(request.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the agent: none of the launcher's descriptors but its log
                if self._selector is not None:
                    self._selector.close()
                listener.close()
                conn.close()
                os._exit(self._child(request, log_fd))
        finally:
            os.close(log_fd)
        self._children.add(pid)
        return {"pid": pid}

    def _child(self, request: LaunchRequest, log_fd: int) -> int:
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(log_fd)
            replace_environment(request.env)
            self._title.write(request.argv, request.env)
            code = self.entry(request.argv[len(self.agent_command) - 1 :])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        return code


def _read_request(conn: socket.socket) -> bytes:
    """One request: up to a newline or the end of what the peer sends, at most MAX_REQUEST bytes."""
    data = bytearray()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while b"\n" not in data:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            raise RequestError(f"no complete request within {REQUEST_TIMEOUT_S:.0f} s") from None
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise RequestError(f"request larger than {MAX_REQUEST} bytes")
    return bytes(data.split(b"\n", 1)[0])


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", file=sys.stderr, flush=True)


def prepare() -> None:
    """Build once what every agent would build alike, before the first fork: the TLS context, and
    what pydantic-settings, asyncio and the HTTP client make at their first use (measured: about
    5 MiB of each agent's private memory otherwise). The agent's modules are imported already: the
    caller's ``entry`` comes with them."""
    import asyncio
    import importlib

    from pydantic import SecretStr, ValidationError

    from hyperpod_sim.agents.config import AgentSettings
    from hyperpod_sim.agents.http import tls
    from hyperpod_sim.agents.http.client import HttpClient

    # boto3 comes only when an agent's S3 tier makes its first call; imported here, its modules
    # are shared (measured, 8 children building an S3 client: 26.8 MiB PSS each, 36.0 when each
    # imports it), and an agent that never calls S3 does not pay for it.
    for module in ("boto3", "boto3.s3.transfer", "botocore.config"):
        importlib.import_module(module)

    tls.client_context()
    # HPSIM_AGENT_* variables a setting refuses are each agent's to report, in its log.
    with contextlib.suppress(ValidationError):
        AgentSettings(control_plane="http://127.0.0.1:1", cluster="warm-up", token=SecretStr("warm-up" * 4))

    async def warm_up() -> None:
        client = HttpClient(timeout=1.0)
        client._open()  # the session and its connector, as an agent's first call makes them
        await client.aclose()

    asyncio.run(warm_up())


def mark_mergeable() -> str:
    """Mark this process's memory, and that of every child it forks from now on, mergeable by the
    kernel's same-page merging (KSM); what came of it, for the log. Nothing is merged unless the
    machine's ksmd runs, which only root can start (``/sys/kernel/mm/ksm/run``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        reason = os.strerror(ctypes.get_errno())
        return f"agents' pages are not mergeable: prctl(PR_SET_MEMORY_MERGE): {reason} (it needs Linux 6.4)"
    try:
        running = KSM_RUN.read_text().strip() == "1"
    except OSError:
        running = False
    if running:
        return "agents' pages are mergeable and ksmd runs: pages the agents hold alike are kept once"
    return (
        "agents' pages are mergeable, but ksmd does not run: nothing is merged "
        f"(as root: echo 1 > {KSM_RUN}; docs/nodes.md)"
    )


def run_launcher(
    *, socket_path: Path, parent: int, entry: Entry, agent_command: Sequence[str], merge_pages: bool = True
) -> int:
    """``hyperpod-sim agent-launcher``: prepare, then serve until the parent is gone."""
    os.environ.pop(ROOM_VARIABLE, None)
    if merge_pages:
        _say(mark_mergeable())
    with open("/proc/self/cmdline", "rb") as handle:
        own = [arg.decode(errors="surrogateescape") for arg in handle.read().split(b"\0")[:-1]]
    if "--room" in own:  # ps shows the launcher without its padding
        at = own.index("--room")
        Title().write(own[:at] + own[at + 2 :])
    prepare()
    launcher = Launcher(socket_path=socket_path, parent=parent, entry=entry, agent_command=agent_command)
    try:
        return launcher.serve()
    except OSError as exc:
        _say(f"agent launcher cannot serve: {exc}")
        return 1
