"""The control plane's one HTTP client for its calls to agents: policy pushes (domain/checkpoints/pushes.py)
and the checkpoint listing's index reads (hyperpod_sim/domain/checkpoints/listing.py).

Plain ``http.client`` connections (why, measured: docs/decisions/0002-http-client-towards-agents.md).
A connection serves one agent for as long as the caller holds it (the listing reads every
namespace's index over one), sends the control plane's ``User-Agent`` and the caller's bearer
token, and never goes through a proxy from the environment. What goes wrong on the way (connect,
timeout, a reply that is not HTTP) is raised as ``AgentUnreachable``; an answer, whatever its
status, is returned. ``KeptConnections`` keeps one idle connection per agent between callers (the
pusher's: every push of a rollout goes to an agent pushed before).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from hyperpod_sim.contracts.agent_api import CONTROL_PLANE_AGENT

_CLOSED = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class AgentUnreachable(Exception):
    """The agent could not be asked, or its reply was not HTTP."""


@dataclass(frozen=True)
class Answer:
    status: int
    text: str

    def json(self) -> Any:
        """The body as JSON; ValueError if it is not."""
        return json.loads(self.text)


class AgentConnection:
    """One keep-alive connection to the agent at ``endpoint`` (``http://host:port``). ``timeout``:
    for each reply; ``connect_timeout``: for the connection (default ``timeout``)."""

    def __init__(
        self, endpoint: str, *, token: str, timeout: float, connect_timeout: float | None = None
    ) -> None:
        url = urlsplit(endpoint)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 80
        self._token = token
        self._timeout = timeout
        self._connect_timeout = connect_timeout if connect_timeout is not None else timeout
        self._connection: http.client.HTTPConnection | None = None

    def __enter__(self) -> AgentConnection:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @property
    def open(self) -> bool:
        """Whether it holds a connection the next call can use (the agent may have closed it since)."""
        return self._connection is not None

    def call(self, method: str, path: str, *, body: object = None, timeout: float | None = None) -> Answer:
        """``method path`` with ``body`` as JSON (None: no body); the answer. ``timeout``: for
        this reply instead of the connection's."""
        headers = {"Authorization": f"Bearer {self._token}", "User-Agent": CONTROL_PLANE_AGENT}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            reused = self._connection is not None
            try:
                connection = self._connect()
                if connection.sock is not None:
                    connection.sock.settimeout(self._timeout if timeout is None else timeout)
                connection.request(method, path, body=payload, headers=headers)
                response = connection.getresponse()
                text = response.read().decode(errors="replace")
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # A kept-alive connection the agent closed meanwhile: once more on a new one.
                if reused and attempt == 1 and isinstance(exc, _CLOSED):
                    continue
                raise AgentUnreachable(f"{type(exc).__name__}: {exc}") from exc
            if response.will_close:
                self.close()
            return Answer(response.status, text)
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self._connect_timeout)
            connection.connect()
            self._connection = connection
        return self._connection


class KeptConnections:
    """Idle connections to agents, at most one per (endpoint, token), kept ``keep_s`` seconds from
    their last use; a caller that finds none opens one. Thread-safe: the pusher's threads share it.
    A kept connection the agent closed meanwhile costs a retry on a new one (``AgentConnection``)."""

    def __init__(self, *, keep_s: float, timeout: float) -> None:
        self._keep_s = keep_s
        self._timeout = timeout
        self._idle: dict[tuple[str, str], tuple[AgentConnection, float]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._idle)

    @contextmanager
    def connection(self, endpoint: str, token: str) -> Iterator[AgentConnection]:
        """A connection to the agent at ``endpoint``: a kept one, or a new one. It is kept again if
        the caller's calls left it open, and closed if the caller raised."""
        key = (endpoint, token)
        with self._lock:
            kept = self._idle.pop(key, None)
        if kept is not None and time.monotonic() - kept[1] > self._keep_s:
            kept[0].close()
            kept = None
        connection = (
            kept[0] if kept is not None else AgentConnection(endpoint, token=token, timeout=self._timeout)
        )
        try:
            yield connection
        except BaseException:
            connection.close()
            raise
        if not connection.open:
            return
        with self._lock:
            replaced = self._idle.get(key)
            self._idle[key] = (connection, time.monotonic())
        if replaced is not None:
            replaced[0].close()

    def sweep(self) -> None:
        """Close the connections idle for longer than ``keep_s`` (agents gone, endpoints changed)."""
        cutoff = time.monotonic() - self._keep_s
        with self._lock:
            old = [key for key, (_, used) in self._idle.items() if used < cutoff]
            closing = [self._idle.pop(key)[0] for key in old]
        for connection in closing:
            connection.close()

    def close(self) -> None:
        with self._lock:
            closing = [connection for connection, _ in self._idle.values()]
            self._idle.clear()
        for connection in closing:
            connection.close()
