"""The control plane's one HTTP client for its calls to agents: policy pushes (domain/checkpoints/pushes.py)
and the checkpoint listing's index reads (hyperpod_sim/domain/checkpoints/listing.py).

Plain sockets, HTTP/1.1 with keep-alive, answers parsed by ``httptools`` (why, measured:
docs/decisions/0002-http-client-towards-agents.md). A connection serves one agent for as long as
the caller holds it (the listing reads every namespace's index over one), sends the control
plane's ``User-Agent`` and the caller's bearer token, and never goes through a proxy from the
environment. What goes wrong on the way (connect, timeout, a reply that is not HTTP) is
``AgentUnreachable``; an answer, whatever its status, is an ``Answer``.

``exchange`` runs many calls at once from the calling thread, each on its own connection, over
one ``selectors`` loop: a rollout's pushes to a thousand agents are a thousand sockets, not a
thousand blocking calls in threads. ``KeptConnections`` keeps one idle connection per agent
for as long as the caller wants it (the pusher: the node's life).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httptools

from hyperpod_sim.contracts.agent_api import CONTROL_PLANE_AGENT

_READ_BYTES = 65536
_CLOSED = (BrokenPipeError, ConnectionResetError)


class AgentUnreachable(Exception):
    """The agent could not be asked, or its reply was not HTTP."""


@dataclass(frozen=True)
class Answer:
    status: int
    text: str

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not."""
        return json.loads(self.text)


@dataclass(frozen=True)
class Call:
    """One request to an agent, on ``connection``."""

    connection: AgentConnection
    method: str
    path: str
    body: bytes | None = None  # JSON, sent as application/json
    timeout: float | None = None  # for the reply, instead of the connection's


class _Reply:
    """One response, parsed by httptools as it comes (these are its callbacks)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.keep_alive = False
        self.complete = False

    def on_headers_complete(self) -> None:
        # Asked here: once the message is complete, the parser is ready for the next one.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class AgentConnection:
    """One keep-alive connection to the agent at ``endpoint`` (``http://host:port``). ``timeout``:
    for each reply; ``connect_timeout``: for the connection (default ``timeout``)."""

    def __init__(
        self, endpoint: str, *, token: str, timeout: float, connect_timeout: float | None = None
    ) -> None:
        url = urlsplit(endpoint)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout if connect_timeout is not None else timeout
        self.sock: socket.socket | None = None

    def __enter__(self) -> AgentConnection:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    @property
    def open(self) -> bool:
        """Whether it holds a connection the next call can use (the agent may have closed it since)."""
        return self.sock is not None

    def call(self, method: str, path: str, *, body: object = None, timeout: float | None = None) -> Answer:
        """``method path`` with ``body`` as JSON (None: no body); the answer. ``timeout``: for
        this reply instead of the connection's. AgentUnreachable if there is none."""
        payload = None if body is None else json.dumps(body).encode()
        (result,) = exchange([Call(self, method, path, payload, timeout)])
        if isinstance(result, AgentUnreachable):
            raise result
        return result

    def request_bytes(self, call: Call) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        head = (
            f"{call.method} {call.path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
            f"User-Agent: {CONTROL_PLANE_AGENT}\r\nAuthorization: Bearer {self.token}\r\n"
        )
        if call.body is None:
            return (head + "\r\n").encode()
        head += f"Content-Type: application/json\r\nContent-Length: {len(call.body)}\r\n\r\n"
        return head.encode() + call.body


@dataclass
class _Exchange:
    """A call under way: its request's bytes left to send, its reply so far, when it times out."""

    index: int
    call: Call
    request: bytes
    deadline: float
    # For the whole answer once connected, not for each silence: an agent that drips its answer
    # a byte at a time cannot hold the pass that pushes to it past the timeout.
    timeout: float
    reused: bool  # on a kept connection (one the agent may have closed while it was idle)
    reply: _Reply
    sent: int = 0
    connecting: bool = False
    received: bool = False  # a byte of the reply came


def exchange(calls: Sequence[Call], *, window: int | None = None) -> list[Answer | AgentUnreachable]:
    """Make ``calls`` (each on its own connection), at most ``window`` at once (all: None): what
    each got, in their order. Never raises for one call's failure. A kept connection the agent
    closed while it was idle is retried once on a new one."""
    with _Exchanges(calls) as exchanges:
        return exchanges.run(len(calls) if window is None else max(1, window))


class _Exchanges:
    """``exchange``'s loop: non-blocking sockets on one selector, topped up to the window."""

    def __init__(self, calls: Sequence[Call]) -> None:
        self.results: list[Answer | AgentUnreachable | None] = [None] * len(calls)
        self.waiting: deque[tuple[int, Call, bool]] = deque((i, c, False) for i, c in enumerate(calls))
        self.under_way: dict[socket.socket, _Exchange] = {}
        self.selector = selectors.DefaultSelector()

    def __enter__(self) -> _Exchanges:
        return self

    def __exit__(self, *exc: object) -> None:
        for ex in list(self.under_way.values()):  # only if run() raised: nothing is left open
            ex.call.connection.close()
        self.selector.close()

    def run(self, window: int) -> list[Answer | AgentUnreachable]:
        while self.waiting or self.under_way:
            while self.waiting and len(self.under_way) < window:
                self.start(*self.waiting.popleft())
            if not self.under_way:
                continue
            soonest = min(ex.deadline for ex in self.under_way.values())
            for key, events in self.selector.select(max(0.0, soonest - time.monotonic())):
                ex = key.data
                if self.under_way.get(key.fileobj) is not ex:  # type: ignore[call-overload]
                    continue
                if events & selectors.EVENT_WRITE:
                    self.write(ex)
                elif events & selectors.EVENT_READ:
                    self.read(ex)
            now = time.monotonic()
            for ex in [ex for ex in self.under_way.values() if ex.deadline <= now]:
                agent = ex.call.connection
                what = "connection" if ex.connecting else "answer"
                self.fail(ex, f"TimeoutError: no {what} from {agent.host}:{agent.port} in time")
        return [r if r is not None else AgentUnreachable("not sent") for r in self.results]

    def start(self, index: int, call: Call, retry: bool) -> None:
        connection = call.connection
        timeout = connection.timeout if call.timeout is None else call.timeout
        connecting = connection.sock is None
        ex = _Exchange(
            index=index,
            call=call,
            request=connection.request_bytes(call),
            deadline=time.monotonic() + (connection.connect_timeout if connecting else timeout),
            timeout=timeout,
            reused=not connecting and not retry,
            reply=_Reply(),
            connecting=connecting,
        )
        try:
            if connection.sock is None:
                connection.sock = _connect(connection.host, connection.port)
            self.under_way[connection.sock] = ex
            self.selector.register(connection.sock, selectors.EVENT_WRITE, ex)
        except (OSError, ValueError) as exc:  # ValueError: a host name idna cannot encode
            self.fail(ex, f"{type(exc).__name__}: {exc}")

    def finish(self, ex: _Exchange, result: Answer | AgentUnreachable, *, retry: bool = False) -> None:
        connection = ex.call.connection
        sock = connection.sock
        if sock is not None and self.under_way.get(sock) is ex:
            del self.under_way[sock]
            self.selector.unregister(sock)
        if isinstance(result, AgentUnreachable):
            connection.close()
            # A kept connection the agent closed while it was idle: once more, on a new one.
            if retry and ex.reused and not ex.received:
                self.waiting.appendleft((ex.index, ex.call, True))
                return
        self.results[ex.index] = result

    def fail(self, ex: _Exchange, message: str, *, closed: bool = False) -> None:
        self.finish(ex, AgentUnreachable(message), retry=closed)

    def write(self, ex: _Exchange) -> None:
        connection = ex.call.connection
        sock = connection.sock
        assert sock is not None
        if ex.connecting:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                error = OSError(code, os.strerror(code))  # its subclass: ConnectionRefusedError, ...
                self.fail(ex, f"{type(error).__name__}: {error}")
                return
            ex.connecting = False
            ex.deadline = time.monotonic() + ex.timeout
        try:
            ex.sent += sock.send(memoryview(ex.request)[ex.sent :])
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(ex, f"{type(exc).__name__}: {exc}", closed=isinstance(exc, _CLOSED))
            return
        if ex.sent >= len(ex.request):
            self.selector.modify(sock, selectors.EVENT_READ, ex)

    def read(self, ex: _Exchange) -> None:
        connection = ex.call.connection
        sock = connection.sock
        assert sock is not None
        try:
            data = sock.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(ex, f"{type(exc).__name__}: {exc}", closed=isinstance(exc, _CLOSED))
            return
        if not data:
            self.fail(
                ex, "RemoteDisconnected: the agent closed the connection without an answer", closed=True
            )
            return
        ex.received = True
        try:
            ex.reply.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(ex, f"not an HTTP answer: {exc}")
            return
        if not ex.reply.complete:
            return
        status = ex.reply.parser.get_status_code()
        self.finish(ex, Answer(status, b"".join(ex.reply.body).decode(errors="replace")))
        if not ex.reply.keep_alive:
            connection.close()


def _connect(host: str, port: int) -> socket.socket:
    """A non-blocking socket connecting to ``host:port`` (numeric addresses: no resolver call)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socket.inet_pton(family, host)
    except OSError:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, host = found[0], str(found[4][0])
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    code = sock.connect_ex((host, port))
    if code not in (0, errno.EINPROGRESS):
        sock.close()
        raise OSError(code, os.strerror(code))  # its subclass: ConnectionRefusedError, ...
    return sock


class KeptConnections:
    """Idle connections to agents, at most one per (endpoint, token), kept until ``drop``ped; a
    caller that finds none opens one. Thread-safe. A kept connection the agent closed meanwhile
    costs a retry on a new one (``exchange``)."""

    def __init__(self, *, timeout: float) -> None:
        self._timeout = timeout
        self._idle: dict[tuple[str, str], AgentConnection] = {}
        self._lock = threading.Lock()

    def take(self, endpoint: str, token: str) -> AgentConnection:
        """The kept connection to the agent at ``endpoint``, or a new one; ``give_back`` it."""
        with self._lock:
            kept = self._idle.pop((endpoint, token), None)
        return kept if kept is not None else AgentConnection(endpoint, token=token, timeout=self._timeout)

    def give_back(self, endpoint: str, connection: AgentConnection) -> None:
        """Keep ``connection`` (taken for ``endpoint``) if its calls left it open."""
        if not connection.open:
            return
        with self._lock:
            replaced = self._idle.get((endpoint, connection.token))
            self._idle[(endpoint, connection.token)] = connection
        if replaced is not None and replaced is not connection:
            replaced.close()

    def holds(self, endpoint: str, token: str) -> bool:
        """Whether an idle connection to the agent at ``endpoint`` is kept."""
        with self._lock:
            return (endpoint, token) in self._idle

    def drop(self, endpoint: str, token: str) -> None:
        """Close the kept connection to the agent at ``endpoint``, if any (its node left)."""
        with self._lock:
            kept = self._idle.pop((endpoint, token), None)
        if kept is not None:
            kept.close()

    def close(self) -> None:
        with self._lock:
            closing = list(self._idle.values())
            self._idle.clear()
        for connection in closing:
            connection.close()
