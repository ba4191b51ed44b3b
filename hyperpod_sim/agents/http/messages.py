"""The messages of the agent's HTTP server: a parsed request (whose body is still on the wire), a
response, and the errors a handler or the parser may raise. See :mod:`agents.httpserver`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, BinaryIO, Protocol

from hyperpod_sim.agents.numbers import canonical_int

MAX_HEADER_BYTES = 16 * 1024  # request line and headers (431 beyond); also the bound of chunked trailers
MAX_BODY_BYTES = 1024 * 1024  # read_body's default limit (413 beyond)
_CHUNK_LINE_BYTES = 4096


class BodySource(Protocol):
    """What a :class:`Request` reads its body from: the connection it came on."""

    async def readinto(self, view: memoryview) -> None: ...

    async def read_some(self, limit: int) -> bytes: ...

    async def read_line(self, limit: int) -> bytes: ...

    def start_body_deadline(self, length: int) -> None: ...

    def extend_body_deadline(self, length: int) -> None: ...

    def write_continue(self) -> None: ...


@dataclass(frozen=True)
class FileBody:
    """``length`` bytes of an open binary file (or file descriptor) from ``offset``.

    Sent with ``loop.sendfile``: ``os.sendfile`` for TCP on Linux, read-and-write elsewhere. The
    server does not close the file (use :attr:`Response.on_sent`) and moves its file position. The
    file must hold ``length`` bytes from ``offset``; if it turns out shorter, the client gets fewer
    bytes than the ``Content-Length`` and the connection is closed.
    """

    file: BinaryIO | int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"FileBody offset and length must not be negative: {self.offset}, {self.length}")


@dataclass(frozen=True, kw_only=True)
class Response:
    """A status, headers and one body: ``body`` (bytes or a memoryview), or ``file``.

    ``on_sent`` is called once, when the server is done with the body: after its last byte was handed
    to the kernel, or when sending failed, the connection broke or the server shut down; the owner can
    then release the buffer or close the file. With a :class:`FileBody` sent by ``os.sendfile``, the
    kernel may still read the file's pages after that (until the client has received them): closing or
    unlinking the file is safe then, overwriting those bytes in place is not.
    """

    status: int
    body: bytes | bytearray | memoryview = b""
    file: FileBody | None = None
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    on_sent: Callable[[], None] | None = None
    # How long the connection may then wait for its next request; None: the server's idle timeout.
    # A caller the handler trusts (the control plane, by its token) may keep its connection longer.
    keep_idle_s: float | None = None

    def __post_init__(self) -> None:
        if self.file is not None and len(self.body):
            raise ValueError("a Response has either a body or a file, not both")

    @property
    def content_length(self) -> int:
        return self.file.length if self.file is not None else memoryview(self.body).nbytes


Handler = Callable[["Request"], Awaitable[Response]]


def json_response(status: int, payload: Any, *, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status=status, body=json.dumps(payload).encode(), headers=headers)


def error_response(
    status: int, error: str, message: str, *, headers: tuple[tuple[str, str], ...] = (), **extra: Any
) -> Response:
    return json_response(status, {"error": error, "message": message, **extra}, headers=headers)


class BadRequest(Exception):
    """Not a request we serve (400, 411, 413, 431, 501...): answered, then the connection is closed.

    Raised by the parser and by the body readers; a handler may raise it too.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> Response:
        code = HTTPStatus(self.status).phrase.replace(" ", "")  # BadRequest, RequestEntityTooLarge...
        return error_response(self.status, code, self.message)


class BodyDeadlineExceeded(TimeoutError):
    """A request body did not arrive within its deadline (answered 408, then the connection closes)."""


class DropConnection(Exception):
    """Raised by a handler to close the connection without answering (a simulated network fault)."""


class ClientDisconnected(ConnectionError):
    """The client closed or reset the connection before the end of the request body."""


class Request:
    """One request: its head, parsed, and its body, still on the wire.

    The handler reads the body, before it returns, with :meth:`read_body`, :meth:`readinto` or
    :meth:`stream` (they can be mixed; each continues where the last stopped). A read that finds the
    client gone raises :class:`ClientDisconnected` (nothing is answered then); one that gets no byte
    for the server's ``read_timeout_s`` raises :class:`TimeoutError` (answered 408 unless the handler
    answers itself). Either way the connection is closed after that request.
    """

    __slots__ = (
        "_after_chunk",
        "_body_started",
        "_chunk_left",
        "_conn",
        "_continue_sent",
        "_done",
        "_remaining",
        "content_length",
        "expect_continue",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
    )

    def __init__(
        self,
        *,
        conn: BodySource,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        content_length: int | None,
        keep_alive: bool,
        expect_continue: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # names lower-cased; repeated headers joined with ", "
        self.content_length = content_length  # None: Transfer-Encoding: chunked
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self._conn = conn
        self._remaining = content_length or 0  # Content-Length bytes not read yet
        self._chunk_left = 0  # chunked: bytes of the current chunk not read yet
        self._after_chunk = False  # chunked: the CRLF after a chunk's data is due
        self._done = content_length is not None and content_length == 0
        self._continue_sent = False
        self._body_started = False

    @property
    def body_done(self) -> bool:
        """Whether the whole body has been read (always true for a request without one)."""
        return self._done

    async def read_body(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The rest of the body; :class:`BadRequest` 413 (before reading anything, when the length is
        known) if it is longer than ``limit`` bytes."""
        if self.content_length is not None:
            if self._remaining > limit:
                raise BadRequest(413, f"request body larger than {limit} bytes")
            buffer = bytearray(self._remaining)
            await self.readinto(memoryview(buffer))
            return bytes(buffer)
        pieces: list[bytes] = []
        size = 0
        async for piece in self.stream():
            size += len(piece)
            if size > limit:
                raise BadRequest(413, f"request body larger than {limit} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes of the body, receiving straight into it.

        The body must have a ``Content-Length`` (:class:`BadRequest` 411 for a chunked one), and at
        least ``len(view)`` bytes of it must be left (``ValueError`` otherwise: check
        :attr:`content_length` first). ``view`` must be writable and C-contiguous; any format.
        """
        if self.content_length is None:
            raise BadRequest(411, "this request needs a Content-Length; chunked bodies are not accepted here")
        if view.readonly:
            raise ValueError("readinto needs a writable buffer")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if len(view) > self._remaining:
            raise ValueError(f"readinto of {len(view)} bytes; {self._remaining} bytes of the body are left")
        if not len(view):
            return
        self._start_body()
        self._send_continue()
        await self._conn.readinto(view)
        self._remaining -= len(view)
        self._done = self._remaining == 0

    async def stream(self) -> AsyncIterator[bytes]:
        """The rest of the body as it arrives, in pieces of at most 64 KiB (chunked bodies too)."""
        if self._done:
            return
        self._start_body()
        self._send_continue()
        conn = self._conn
        if self.content_length is not None:
            while self._remaining:
                piece = await conn.read_some(self._remaining)
                self._remaining -= len(piece)
                self._done = self._remaining == 0
                yield piece
            return
        while not self._done:
            if self._chunk_left:
                piece = await conn.read_some(self._chunk_left)
                self._chunk_left -= len(piece)
                yield piece
                continue
            if self._after_chunk:
                if await conn.read_line(0) != b"":
                    raise BadRequest(400, "malformed chunked body: chunk data longer than its size")
                self._after_chunk = False
            line = (await conn.read_line(_CHUNK_LINE_BYTES)).split(b";", 1)[0].strip()
            # Hex digits only (int() would take a sign, "0x", "_" and whitespace), within int64.
            if not line or len(line) > 16 or line.strip(b"0123456789abcdefABCDEF"):
                raise BadRequest(400, f"malformed chunk size {line[:40]!r}")
            size = int(line, 16)
            conn.extend_body_deadline(size)
            if size == 0:
                trailers = 0
                while line := await conn.read_line(MAX_HEADER_BYTES):
                    trailers += len(line) + 2  # trailers: ignored, but bounded
                    if trailers > MAX_HEADER_BYTES:
                        raise BadRequest(431, f"chunked trailers larger than {MAX_HEADER_BYTES} bytes")
                self._done = True
                return
            self._chunk_left = size
            self._after_chunk = True

    def _start_body(self) -> None:
        """The body's deadline runs from its first read (after the handler's own work, such as
        making room for a shard): base + length / minimum rate (docs/memory-tier.md, "Limits")."""
        if not self._body_started:
            self._body_started = True
            self._conn.start_body_deadline(self.content_length or 0)

    def _send_continue(self) -> None:
        if self.expect_continue and not self._continue_sent and not self._done:
            self._continue_sent = True
            self._conn.write_continue()

    @property
    def _continue_pending(self) -> bool:
        """The client waits for 100 Continue before sending the body, and it was never sent."""
        return self.expect_continue and not self._continue_sent


def parse_head(head: str, *, conn: BodySource) -> Request:
    """The request whose head (request line and headers, without the blank line) is ``head``;
    :class:`BadRequest` if it is not one we serve. ``conn`` will carry its body."""
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, f"malformed request line {lines[0][:100]!r}")
    if not (parts[0].isascii() and parts[0].isalpha()):
        raise BadRequest(400, f"malformed request line {lines[0][:100]!r}")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, f"malformed header line {line[:100]!r}")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    encoding = headers.get("transfer-encoding", "").lower()
    content_length: int | None
    if encoding:
        if "content-length" in headers:
            raise BadRequest(400, "both Transfer-Encoding and Content-Length")
        if encoding != "chunked":
            raise BadRequest(501, f"unsupported Transfer-Encoding {encoding!r}")
        content_length = None
    else:
        raw_length = headers.get("content-length", "0")
        try:
            content_length = canonical_int(raw_length, what="Content-Length")
        except ValueError as exc:
            raise BadRequest(400, f"malformed Content-Length: {exc}") from exc
    path, _, query = target.partition("?")
    return Request(
        conn=conn,
        method=method.upper(),
        path=path,
        query=query,
        headers=headers,
        content_length=content_length,
        keep_alive=keep_alive,
        expect_continue=version == "HTTP/1.1" and headers.get("expect", "").lower() == "100-continue",
    )
