"""A small HTTP/1.1 server on asyncio, for the agent's admin API and its checkpoint tier.

Why the agents have a server of their own, and the measurement behind it:
docs/decisions/0001-agent-http-server.md. It serves requests with ``Content-Length`` or chunked
bodies, keep-alive, ``Expect: 100-continue``, bounded header sizes, idle and read timeouts, an
overall deadline per request body (a minimum transfer rate), and a shutdown that closes every
connection. Handlers are
coroutines taking a :class:`Request` and returning a :class:`Response`.

Bodies are the handler's to read, and may be large (checkpoint shards of several hundred MiB):

* ``await request.read_body()`` returns a small body as ``bytes`` (413 over the limit, 1 MiB by
  default); ``request.stream()`` yields it piece by piece (chunked bodies too).
* ``await request.readinto(view)`` fills a buffer the handler owns (an mmap of a shared-memory file)
  straight from the socket: the connection is an :class:`asyncio.BufferedProtocol`, and while a
  ``readinto`` waits, the buffer the event loop receives into *is* the rest of ``view``, so the bytes
  are copied once, by the kernel. Only what arrived together with the request head (at most
  64 KiB) goes through the connection's own buffer first.
* ``Expect: 100-continue`` is answered when the handler starts reading the body; a handler that
  answers without reading it never makes the client send it.
* What the handler leaves unread is read and dropped after it returns when it is at most
  :data:`DRAIN_MAX_BYTES` (the connection stays open); a larger rest makes the answer carry
  ``Connection: close``, after which the server shuts its side down and drops what still arrives
  for a moment (a "lingering close", as nginx does) so that the client reads the answer instead of
  a connection reset.

Responses carry ``bytes``, a ``memoryview`` (written in slices, not joined into one ``bytes``) or a
:class:`FileBody` sent with :meth:`asyncio.AbstractEventLoop.sendfile` (``os.sendfile`` on Linux:
the file's pages go to the socket without passing through Python). ``Response.on_sent`` tells the
owner of the buffer or file when the server is done with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from hyperpod_sim.agents.http.connection import DRAIN_MAX_BYTES, LINGER_S, Connection
from hyperpod_sim.agents.http.messages import (
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    BadRequest,
    BodyDeadlineExceeded,
    ClientDisconnected,
    DropConnection,
    FileBody,
    Handler,
    Request,
    Response,
    error_response,
    json_response,
)

__all__ = [
    "DRAIN_MAX_BYTES",
    "LINGER_S",
    "MAX_BODY_BYTES",
    "MAX_HEADER_BYTES",
    "BadRequest",
    "BodyDeadlineExceeded",
    "ClientDisconnected",
    "DropConnection",
    "FileBody",
    "Handler",
    "HttpServer",
    "Request",
    "Response",
    "error_response",
    "json_response",
]


class HttpServer:
    def __init__(
        self,
        *,
        handler: Handler,
        sock: socket.socket,
        idle_timeout_s: float = 60.0,
        read_timeout_s: float = 10.0,
        write_timeout_s: float = 30.0,
        body_deadline_base_s: float = 30.0,
        body_min_rate_bytes_per_s: float = 1024 * 1024,
    ) -> None:
        """``idle_timeout_s``: how long a connection may wait for its next request;
        ``read_timeout_s``: how long a request head may take from its first byte, and how long a body
        read may wait without receiving a byte; ``write_timeout_s``: how long a response may wait for
        the client to take more of it (at most 16 MiB of a file, 1 MiB of a body, at a time).

        A body must also arrive whole within ``body_deadline_base_s + length /
        body_min_rate_bytes_per_s`` of its first read (a chunked body's deadline grows by each
        chunk's size): a client that sends a byte now and then cannot hold a request (and the memory
        reserved for it) for longer. Past it, reading raises :class:`BodyDeadlineExceeded`: 408."""
        if body_deadline_base_s <= 0 or body_min_rate_bytes_per_s <= 0:
            raise ValueError("the body deadline's base and minimum rate must be positive")
        self.handler = handler
        self._sock = sock
        self.idle_timeout_s = idle_timeout_s
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.body_deadline_base_s = body_deadline_base_s
        self.body_min_rate_bytes_per_s = body_min_rate_bytes_per_s
        self._server: asyncio.Server | None = None
        self.connections: set[Connection] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), sock=self._sock)

    async def close(self) -> None:
        """Stop accepting, then close every open connection (a handler in progress is cancelled)."""
        if self._server is not None:
            self._server.close()
        tasks = [conn.task for conn in self.connections if conn.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
