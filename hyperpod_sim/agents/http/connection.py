"""One connection of the agent's HTTP server: the protocol the event loop feeds, and the task that
reads its requests, runs the handler and writes the responses. See :mod:`agents.httpserver`.

Time here is the event loop's clock (``loop.time()``): the timeouts and body deadlines follow the
loop, never the wall clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from http import HTTPStatus
from typing import IO, Protocol

from hyperpod_sim.agents.http.messages import (
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
    parse_head,
)

log = logging.getLogger("hyperpod_sim.agents.http")

DRAIN_MAX_BYTES = 1024 * 1024  # an unread body up to this is dropped to keep the connection; above: close
LINGER_S = 2.0  # after a close with request bytes still coming: how long to read and drop them

_BUFFER_BYTES = 64 * 1024  # per connection: request heads, small bodies, what a readinto finds waiting
_INLINE_BODY_BYTES = 64 * 1024  # response bodies up to this go out in the same write() as the head
_WRITE_SLICE_BYTES = 1024 * 1024  # a larger bytes/memoryview body is written in slices of this size
_SENDFILE_SEGMENT_BYTES = 16 * 1024 * 1024  # a FileBody is sent in segments, each within write_timeout_s


class Server(Protocol):
    """What a connection needs of its server (:class:`agents.httpserver.HttpServer`): the handler,
    the limits, and the set of open connections it adds itself to."""

    handler: Handler
    connections: set[Connection]
    idle_timeout_s: float
    read_timeout_s: float
    write_timeout_s: float
    body_deadline_base_s: float
    body_min_rate_bytes_per_s: float


class Connection(asyncio.BufferedProtocol):
    """One client connection: the protocol the event loop feeds, and the task that serves it.

    Received bytes land in one of three places, chosen by :meth:`get_buffer`: the caller's buffer
    while a :meth:`readinto` is waiting (``_sink``), nowhere while lingering (``_discard``), or the
    connection's own buffer (``_buffer[_start:_end]`` holds what was received and not consumed yet).
    Reading pauses when that buffer is full, and resumes when something is consumed.
    """

    def __init__(self, server: Server) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._sink: memoryview | None = None
        self._sink_pos = 0
        self._discard = False
        self._eof = False
        self._lost = False
        self._broken = False  # a body read failed: the request stream is out of step, close
        self._stalled = False  # ... because no byte came for read_timeout_s
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._activity = 0.0
        self._body_deadline: float | None = None  # loop time by which the current body must be in
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._closed: asyncio.Future[None] = self._loop.create_future()
        self._idle_s: float | None = None  # the last answer's keep_idle_s
        self.task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        # Each slice of a large body is written when the previous one has left entirely, so the
        # transport's send() takes it from the caller's buffer and never copies a whole slice.
        transport.set_write_buffer_limits(high=0)
        self._server.connections.add(self)
        self.task = self._loop.create_task(self._serve())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is not None:
            return self._sink[self._sink_pos :]
        if self._discard:
            return self._view
        if self._end == len(self._buffer):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._discard:
            return
        self._activity = self._loop.time()
        if self._sink is not None:
            self._sink_pos += nbytes
            if self._sink_pos == len(self._sink):
                self._sink = None
                self._wake()
            return
        self._end += nbytes
        if self._end - self._start == len(self._buffer) and self._transport is not None:
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep our side open: the request before the EOF still gets its answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._eof = True
        self._sink = None
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # ------------------------------------------------------------------ reading

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _compact(self) -> None:
        size = self._end - self._start
        if self._start:
            self._buffer[:size] = self._buffer[self._start : self._end]
            self._start, self._end = 0, size

    def _consume(self, nbytes: int) -> None:
        self._start += nbytes
        if self._start == self._end:
            self._start = self._end = 0
        self._resume_reading()

    def _resume_reading(self) -> None:
        transport = self._transport
        if transport is not None and not self._lost and not transport.is_reading():
            transport.resume_reading()

    def start_body_deadline(self, length: int) -> None:
        server = self._server
        self._body_deadline = (
            self._loop.time() + server.body_deadline_base_s + length / server.body_min_rate_bytes_per_s
        )

    def extend_body_deadline(self, length: int) -> None:
        if self._body_deadline is not None:
            self._body_deadline += length / self._server.body_min_rate_bytes_per_s

    async def _wait(self, timeout: float, *, limit: float | None = None) -> None:
        """Until bytes arrive in the buffer (in sink mode: until the sink is full), EOF or the end of the
        connection; :class:`TimeoutError` when no byte at all arrived for ``timeout`` seconds, and
        :class:`BodyDeadlineExceeded` at the loop time ``limit`` (a body's deadline)."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._activity = self._loop.time()
        self._timer = self._loop.call_at(
            _earliest(self._activity + timeout, limit), self._check_stall, waiter, timeout, limit
        )
        try:
            await waiter
        finally:
            self._waiter = None
            self._timer.cancel()

    def _check_stall(self, waiter: asyncio.Future[None], timeout: float, limit: float | None) -> None:
        if waiter.done():
            return
        now = self._loop.time()
        if limit is not None and now + 0.001 >= limit:
            server = self._server
            waiter.set_exception(
                BodyDeadlineExceeded(
                    f"the request body did not arrive within its deadline ({server.body_deadline_base_s:g} s "
                    f"+ its length at {server.body_min_rate_bytes_per_s:g} bytes/s); nothing was kept"
                )
            )
            return
        deadline = self._activity + timeout  # bytes into a sink move _activity without waking the waiter
        if now + 0.001 < deadline:
            self._timer = self._loop.call_at(
                _earliest(deadline, limit), self._check_stall, waiter, timeout, limit
            )
        else:
            waiter.set_exception(TimeoutError(f"no byte received for {timeout:g} s"))

    async def _fill(self) -> None:
        """Wait for more body bytes in the buffer."""
        if self._eof:
            self._broken = True
            raise ClientDisconnected("the client closed the connection before the end of the request body")
        self._resume_reading()
        try:
            await self._wait(self._server.read_timeout_s, limit=self._body_deadline)
        except TimeoutError:
            self._broken = self._stalled = True
            raise

    async def read_some(self, limit: int) -> bytes:
        while self._start == self._end:
            await self._fill()
        size = min(limit, self._end - self._start)
        piece = bytes(self._view[self._start : self._start + size])
        self._consume(size)
        return piece

    async def read_line(self, limit: int) -> bytes:
        """The next line, without its CRLF; a line longer than ``limit`` is a :class:`BadRequest`."""
        scanned = 0
        while True:
            end = self._buffer.find(b"\r\n", self._start + scanned, self._end)
            if end >= 0:
                if end - self._start > limit:
                    break
                line = bytes(self._view[self._start : end])
                self._consume(end + 2 - self._start)
                return line
            if self._end - self._start > limit + 1:
                break
            scanned = max(self._end - self._start - 1, 0)
            await self._fill()
        raise BadRequest(400, "malformed chunked body: a line is too long")

    async def readinto(self, view: memoryview) -> None:
        total = len(view)
        have = min(self._end - self._start, total)
        if have:
            view[:have] = self._view[self._start : self._start + have]
            self._consume(have)
        if have == total:
            return
        if self._eof:
            self._broken = True
            raise ClientDisconnected("the client closed the connection before the end of the request body")
        self._sink = view
        self._sink_pos = have
        self._resume_reading()
        try:
            while self._sink_pos < total:  # buffer_updated moves it; EOF, loss and stalls end the wait too
                if self._eof:
                    self._broken = True
                    raise ClientDisconnected(
                        f"the client closed the connection after {self._sink_pos} of {total} bytes"
                    )
                try:
                    await self._wait(self._server.read_timeout_s, limit=self._body_deadline)
                except TimeoutError:
                    self._broken = self._stalled = True
                    raise
        finally:
            self._sink = None  # the event loop must never write into the caller's buffer after this

    # ------------------------------------------------------------------ the request loop

    async def _serve(self) -> None:
        transport = self._transport
        assert transport is not None
        try:
            while not self._eof or self._start != self._end:
                self._body_deadline = None
                try:
                    request = await self._read_head()
                except BadRequest as exc:
                    await self._send(exc.response(), keep_alive=False)
                    await self._linger()
                    return
                if request is None:
                    return
                if not await self._answer(request):
                    return
        except (ConnectionError, TimeoutError) as exc:
            log.debug("connection ended: %r", exc)  # the client went away or stalled: nothing to answer
        except Exception:
            # A bug of ours, not the client's: say so (if the connection can still carry an
            # answer) and log it, rather than leave a task exception that nobody retrieves.
            log.exception("the connection failed outside a handler")
            with contextlib.suppress(Exception):
                if not self._lost and not self._broken:
                    failure = error_response(500, "InternalError", "the agent failed on this request")
                    await self._send(failure, keep_alive=False)
        finally:
            self._server.connections.discard(self)
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._closed), timeout=1.0)

    async def _answer(self, request: Request) -> bool:
        """Run the handler and send its response; whether the connection can serve another request."""
        try:
            response = await self._server.handler(request)
        except DropConnection as exc:
            log.info("%s %s: connection closed unanswered: %s", request.method, request.path, exc)
            return False
        except BadRequest as exc:
            request.keep_alive = False
            response = exc.response()
        except Exception as exc:
            if self._stalled:
                response = error_response(408, "RequestTimeout", str(exc))
            elif self._broken:
                return False  # the client left in the middle of the body: no one to answer
            else:
                log.exception("handler failed on %s %s", request.method, request.path)
                response = error_response(500, "InternalError", "the agent failed on this request")
        keep_alive = False
        try:
            if self._lost or (self._broken and not self._stalled):
                return False
            keep_alive = request.keep_alive and not self._broken and await self._finish_body(request)
            await self._send(response, keep_alive=keep_alive)
            self._idle_s = response.keep_idle_s
        finally:
            if response.on_sent is not None:
                try:
                    response.on_sent()
                except Exception:
                    log.exception("on_sent failed after %s %s", request.method, request.path)
        if not keep_alive and not request.body_done and not self._broken:
            await self._linger()
        return keep_alive

    async def _finish_body(self, request: Request) -> bool:
        """Drop the rest of a body the handler did not read, if that is cheap; whether it was."""
        if request.body_done:
            return True
        if request._continue_pending or self._eof:
            return False  # the client may never send it
        if request.content_length is not None and request._remaining > DRAIN_MAX_BYTES:
            return False
        dropped = 0
        try:
            async for piece in request.stream():
                dropped += len(piece)
                if dropped > DRAIN_MAX_BYTES:
                    return False
        except (BadRequest, ConnectionError, TimeoutError):
            return False
        return True

    async def _read_head(self) -> Request | None:
        """The next request's head; None when the client closed or the connection was idle too long."""
        scanned = 0
        deadline: float | None = None
        while True:
            while self._buffer.startswith(b"\r\n", self._start, self._end):
                self._consume(2)  # empty lines between requests are allowed (RFC 9112 2.2)
                scanned = 0
            head_end = self._buffer.find(b"\r\n\r\n", self._start + max(scanned - 3, 0), self._end)
            if head_end >= 0:
                if head_end + 4 - self._start > MAX_HEADER_BYTES:
                    raise BadRequest(431, f"request head larger than {MAX_HEADER_BYTES} bytes")
                break
            buffered = self._end - self._start
            if buffered >= MAX_HEADER_BYTES:
                raise BadRequest(431, f"request head larger than {MAX_HEADER_BYTES} bytes")
            if self._eof:
                if buffered:
                    raise BadRequest(400, "incomplete request head")
                return None
            scanned = buffered
            if buffered and deadline is None:
                deadline = self._loop.time() + self._server.read_timeout_s
            if deadline is None:
                timeout = self._server.idle_timeout_s if self._idle_s is None else self._idle_s
            else:
                timeout = deadline - self._loop.time()
            try:
                if timeout <= 0:
                    raise TimeoutError
                await self._wait(timeout)
            except TimeoutError:
                return None  # idle, or a head that never ends: close without an answer
        head = bytes(self._view[self._start : head_end]).decode("latin-1")
        self._consume(head_end + 4 - self._start)
        return parse_head(head, conn=self)

    async def _linger(self) -> None:
        """After a closing answer to a client that may still be sending: shut our side down and drop
        what arrives until the client closes or :data:`LINGER_S` passed. Closing at once with unread
        bytes would send a reset, and the client's kernel may throw our answer away on receiving it."""
        transport = self._transport
        if transport is None or self._eof or transport.is_closing():
            return
        with contextlib.suppress(Exception):
            await self._drain()
            transport.write_eof()
        self._discard = True
        self._start = self._end = 0
        self._resume_reading()
        deadline = self._loop.time() + LINGER_S
        while not self._eof:
            timeout = deadline - self._loop.time()
            if timeout <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await self._wait(timeout)

    # ------------------------------------------------------------------ writing

    def write_continue(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _drain(self) -> None:
        """Until the transport's buffer is empty (see the write limits set in connection_made)."""
        if self._lost:
            raise ConnectionResetError("the client closed the connection")
        if not self._write_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiter = waiter
        try:
            await asyncio.wait_for(waiter, self._server.write_timeout_s)
        finally:
            self._drain_waiter = None
        if self._lost:
            raise ConnectionResetError("the client closed the connection")

    async def _send(self, response: Response, *, keep_alive: bool) -> None:
        transport = self._transport
        assert transport is not None
        if transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        length = response.content_length
        try:
            reason = HTTPStatus(response.status).phrase
        except ValueError:
            reason = ""
        head = [
            f"HTTP/1.1 {response.status} {reason}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {length}",
            "Server: hyperpod-sim-agent",
        ]
        if not keep_alive:
            head.append("Connection: close")
        head.extend(f"{name}: {value}" for name, value in response.headers)
        head_bytes = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        if response.file is not None:
            transport.write(head_bytes)
            await self._sendfile(response.file)
            return
        body = memoryview(response.body).cast("B")
        if length <= _INLINE_BODY_BYTES:
            transport.write(head_bytes + body)
        else:
            transport.write(head_bytes)
            for start in range(0, length, _WRITE_SLICE_BYTES):
                await self._drain()
                transport.write(body[start : start + _WRITE_SLICE_BYTES])
        await self._drain()

    async def _sendfile(self, body: FileBody) -> None:
        if isinstance(body.file, int):
            with open(body.file, "rb", buffering=0, closefd=False) as file:
                await self._sendfile_from(file, body)
        else:
            await self._sendfile_from(body.file, body)

    async def _sendfile_from(self, file: IO[bytes], body: FileBody) -> None:
        transport = self._transport
        assert transport is not None
        offset, left = body.offset, body.length
        while left:
            await self._drain()
            count = min(left, _SENDFILE_SEGMENT_BYTES)
            if transport.is_closing():  # loop.sendfile would raise RuntimeError
                raise ConnectionResetError("the connection closed while sending a file")
            sent = await asyncio.wait_for(
                self._loop.sendfile(transport, file, offset, count), self._server.write_timeout_s
            )
            if sent != count:
                transport.abort()
                raise ConnectionAbortedError(
                    f"the file ended {body.length - left + sent} bytes into a {body.length}-byte FileBody"
                )
            offset += sent
            left -= sent


def _earliest(deadline: float, limit: float | None) -> float:
    return deadline if limit is None else min(deadline, limit)
