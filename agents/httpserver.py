"""A small HTTP/1.1 server on asyncio streams, for the agent's admin API.

The agent is part of what a node installs, without the server extra (no uvicorn, no Starlette: the
layering test keeps them out of ``agents/``), and 64 of them share a machine in the benchmarks, so
its server is this: requests with ``Content-Length`` or chunked bodies, keep-alive,
``Expect: 100-continue``, bounded header and body sizes, idle timeouts, and a shutdown that closes
every connection. Handlers are coroutines taking a :class:`Request` and returning a :class:`Response`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

log = logging.getLogger("agents.http")

MAX_HEADER_BYTES = 16 * 1024


@dataclass(frozen=True, kw_only=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # names lower-cased; repeated headers joined with ", "
    body: bytes


@dataclass(frozen=True, kw_only=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]


def json_response(status: int, payload: Any, *, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status=status, body=json.dumps(payload).encode(), headers=headers)


def error_response(
    status: int, error: str, message: str, *, headers: tuple[tuple[str, str], ...] = (), **extra: Any
) -> Response:
    return json_response(status, {"error": error, "message": message, **extra}, headers=headers)


class BadRequest(Exception):
    """The bytes on the wire are not an HTTP request we serve; the connection is closed after the answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HttpServer:
    def __init__(
        self,
        *,
        handler: Handler,
        sock: socket.socket,
        max_body_bytes: int = 1024 * 1024,
        idle_timeout_s: float = 60.0,
        read_timeout_s: float = 10.0,
    ) -> None:
        self._handler = handler
        self._sock = sock
        self._max_body_bytes = max_body_bytes
        self._idle_timeout_s = idle_timeout_s
        self._read_timeout_s = read_timeout_s
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve_connection, sock=self._sock, limit=MAX_HEADER_BYTES
        )

    async def close(self) -> None:
        """Stop accepting, then close every open connection (a handler in progress is cancelled)."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            keep_alive = True
            while keep_alive:
                try:
                    request, keep_alive = await self._read_request(reader, writer)
                except BadRequest as exc:
                    code = HTTPStatus(exc.status).phrase.replace(
                        " ", ""
                    )  # BadRequest, RequestEntityTooLarge...
                    await self._write(writer, error_response(exc.status, code, exc.message), False)
                    return
                if request is None:
                    return
                try:
                    response = await self._handler(request)
                except Exception:
                    log.exception("handler failed on %s %s", request.method, request.path)
                    response = error_response(500, "InternalError", "the agent failed on this request")
                await self._write(writer, response, keep_alive)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # the client went away, stalled or sent an oversized chunk line: nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), timeout=1.0)

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[Request | None, bool]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._idle_timeout_s)
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise BadRequest(400, "incomplete request head") from exc
            return None, False  # the client closed an idle connection
        except asyncio.LimitOverrunError as exc:
            raise BadRequest(431, f"request head larger than {MAX_HEADER_BYTES} bytes") from exc
        except TimeoutError:
            return None, False
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
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
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        body = await asyncio.wait_for(self._read_body(reader, headers), self._read_timeout_s)
        path, _, query = target.partition("?")
        request = Request(method=method.upper(), path=path, query=query, headers=headers, body=body)
        return request, keep_alive

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        encoding = headers.get("transfer-encoding", "").lower()
        if encoding:
            if "content-length" in headers:
                raise BadRequest(400, "both Transfer-Encoding and Content-Length")
            if encoding != "chunked":
                raise BadRequest(501, f"unsupported Transfer-Encoding {encoding!r}")
            return await self._read_chunked(reader)
        raw_length = headers.get("content-length", "0")
        if not raw_length.isdigit():
            raise BadRequest(400, f"malformed Content-Length {raw_length[:40]!r}")
        length = int(raw_length)
        if length > self._max_body_bytes:
            raise BadRequest(413, f"request body larger than {self._max_body_bytes} bytes")
        return await reader.readexactly(length) if length else b""

    async def _read_chunked(self, reader: asyncio.StreamReader) -> bytes:
        body = bytearray()
        while True:
            size_line = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError as exc:
                raise BadRequest(400, "malformed chunk size") from exc
            if size == 0:
                break
            if len(body) + size > self._max_body_bytes:
                raise BadRequest(413, f"request body larger than {self._max_body_bytes} bytes")
            body += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise BadRequest(400, "malformed chunk")
        while (await reader.readuntil(b"\r\n")) != b"\r\n":
            pass  # trailers: ignored
        return bytes(body)

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: Response, keep_alive: bool) -> None:
        try:
            reason = HTTPStatus(response.status).phrase
        except ValueError:
            reason = ""
        head = [
            f"HTTP/1.1 {response.status} {reason}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Server: hyperpod-sim-agent",
        ]
        if not keep_alive:
            head.append("Connection: close")
        head.extend(f"{name}: {value}" for name, value in response.headers)
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body)
        await writer.drain()
