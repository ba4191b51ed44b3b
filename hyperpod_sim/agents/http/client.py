"""The agent's HTTP client: its calls to the control plane's agent API and to the other agents.

One :class:`HttpClient` holds one aiohttp session (a pool of kept connections, the agent's one TLS
context, no proxy or cookie from the environment) and answers each call with an :class:`Answer`,
the status, headers and whole body, or raises :class:`HttpError` when no answer came: the
connection was refused or broke off, or the answer was late. Why aiohttp and not httpx, with the
measurement behind it: docs/decisions/0005-agent-http-client.md.

Timeouts are per wait, as before: ``connect`` for a connection, ``read`` for each wait for more of
the answer (a big shard streams for as long as it keeps coming); waiting for a free connection of
the pool is not bounded (a fan-out to 1,024 agents queues behind 64 connections). A request with a
body must also be sent and answered within ``read`` plus its length at :data:`BODY_MIN_RATE`: a
peer that stops reading (frozen, partitioned) cannot hold an upload for ever (aiohttp has no
timeout of its own for writes; httpx's was 10 s per write).
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import AsyncIterable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from hyperpod_sim.agents.http import tls


class HttpError(Exception):
    """A call that got no answer (refused, broken off, timed out, an address it cannot use)."""


@dataclass(frozen=True)
class Timeout:
    """Seconds to wait for a connection, and for each piece of the answer."""

    connect: float
    read: float

    @classmethod
    def of(cls, value: float | Timeout) -> Timeout:
        return value if isinstance(value, Timeout) else cls(connect=value, read=value)

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect, sock_read=self.read)


@dataclass(frozen=True)
class Answer:
    """An answer, read whole."""

    status_code: int
    headers: Mapping[str, str]  # case-insensitive
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return jsonlib.loads(self.content)


Body = bytes | memoryview | AsyncIterable[bytes]

# The slowest an upload may go, as the agents' server asks of a body (agents/http/server.py).
BODY_MIN_RATE = 1024 * 1024  # bytes a second


class HttpClient:
    """``limit``: connections at once, over every host; ``keepalive_s``: how long an idle one is
    kept; ``before_call``: called before every call, may raise HttpError (a NetworkPartition's
    cut). The session is made at the first call, in the event loop that makes it."""

    def __init__(
        self,
        *,
        timeout: float | Timeout,
        base_url: str = "",
        limit: int = 100,
        keepalive_s: float = 15.0,
        before_call: Callable[[], None] | None = None,
    ) -> None:
        self.timeout = Timeout.of(timeout)
        self.base_url = base_url.rstrip("/")
        self._limit = limit
        self._keepalive_s = keepalive_s
        self._before_call = before_call
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._limit, keepalive_timeout=self._keepalive_s, ssl=tls.client_context()
                ),
                timeout=self.timeout.client_timeout(),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: Body | None = None,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | Timeout | None = None,
    ) -> Answer:
        """``url``: absolute, or a path under ``base_url``. A ``json`` body is sent as JSON."""
        if self._before_call is not None:
            self._before_call()
        options: dict[str, Any] = {"headers": headers, "params": params}
        if json is not None:
            options["json"] = json
        elif content is not None:
            options["data"] = content
        waits = self.timeout if timeout is None else Timeout.of(timeout)
        length = _length(content, headers)
        if length is not None:
            options["timeout"] = aiohttp.ClientTimeout(
                total=waits.connect + waits.read + length / BODY_MIN_RATE,
                sock_connect=waits.connect,
                sock_read=waits.read,
            )
        elif timeout is not None:
            options["timeout"] = waits.client_timeout()
        target = url if "://" in url else f"{self.base_url}{url}"
        try:
            async with self._open().request(method, target, **options) as response:
                body = await response.read()
                return Answer(status_code=response.status, headers=response.headers, content=body)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            # ValueError: an address aiohttp cannot use (InvalidURL is a ClientError already).
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc

    async def get(self, url: str, **options: Any) -> Answer:
        return await self.request("GET", url, **options)

    async def put(self, url: str, **options: Any) -> Answer:
        return await self.request("PUT", url, **options)

    async def post(self, url: str, **options: Any) -> Answer:
        return await self.request("POST", url, **options)

    async def delete(self, url: str, **options: Any) -> Answer:
        return await self.request("DELETE", url, **options)


def _length(content: Body | None, headers: Mapping[str, str] | None) -> int | None:
    """The length of a request's body; None without one (a JSON body is small and counts as
    none), or when a streamed body declares no Content-Length (sent chunked, not bounded)."""
    if content is None:
        return None
    if isinstance(content, bytes | memoryview):
        return memoryview(content).nbytes
    declared = next((v for k, v in (headers or {}).items() if k.lower() == "content-length"), None)
    return int(declared) if declared is not None and declared.isdigit() else None
