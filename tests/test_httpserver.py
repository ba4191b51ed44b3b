"""The agent's HTTP server (``hyperpod_sim/agents/http/server.py``) over real loopback sockets.

The server runs on its own event loop in a thread; the tests are its clients: ``http.client`` for
ordinary requests, a raw socket where the bytes on the wire matter (short bodies, pipelining,
``Expect: 100-continue``, oversized heads). Connection reuse is checked from the client's side:
``http.client`` drops its socket when an answer says ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from pydantic import SecretStr

from hyperpod_sim.agents.app import AgentApp
from hyperpod_sim.agents.http.server import (
    DRAIN_MAX_BYTES,
    MAX_HEADER_BYTES,
    BodyDeadlineExceeded,
    ClientDisconnected,
    FileBody,
    HttpServer,
    Request,
    Response,
    json_response,
)
from hyperpod_sim.agents.state import AgentState
from tests.conftest import wait_for

MiB = 1024 * 1024


def pattern(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


class App:
    """Test routes; what the handlers saw is recorded for the tests to check."""

    def __init__(self, file_path: Path | None = None) -> None:
        self.file_path = file_path
        self.sent: list[str] = []  # on_sent calls, by route
        self.errors: list[BaseException] = []  # exceptions that body reads raised in handlers
        self.blocked = threading.Event()  # set while /block waits
        self.routes: dict[str, Callable[[Request], Awaitable[Response]]] = {
            "GET /ping": self.ping,
            "GET /keep": self.keep,
            "POST /upload": self.upload,
            "PUT /echo": self.echo,
            "POST /ignore": self.ignore,
            "GET /file": self.file,
            "GET /fd": self.fd,
            "GET /view": self.view,
            "GET /block": self.block,
        }

    async def __call__(self, request: Request) -> Response:
        return await self.routes[f"{request.method} {request.path}"](request)

    async def ping(self, request: Request) -> Response:
        return json_response(200, {"pong": True})

    async def keep(self, request: Request) -> Response:
        """An answer that keeps its connection a minute (as the agent's to the control plane)."""
        return replace(json_response(200, {"kept": True}), keep_idle_s=60.0)

    async def upload(self, request: Request) -> Response:
        """Stream the body into an mmap with readinto; answer its size and SHA-256."""
        size = request.content_length or 0  # None (chunked): readinto answers 411 itself
        buffer = mmap.mmap(-1, max(size, 1))
        view = memoryview(buffer)[:size]
        try:
            await request.readinto(view)
            return json_response(200, {"size": size, "sha256": hashlib.sha256(view).hexdigest()})
        except (ClientDisconnected, TimeoutError) as exc:
            self.errors.append(exc)
            raise
        finally:
            view.release()
            buffer.close()

    async def echo(self, request: Request) -> Response:
        return Response(status=200, body=await request.read_body(), content_type="application/octet-stream")

    async def ignore(self, request: Request) -> Response:
        return json_response(200, {"read": False})

    def _range(self, request: Request) -> tuple[int, int]:
        query = parse_qs(request.query)
        return int(query["offset"][0]), int(query["length"][0])

    async def file(self, request: Request) -> Response:
        assert self.file_path is not None
        offset, length = self._range(request)
        handle = open(self.file_path, "rb")  # noqa: SIM115 (closed by on_sent)

        def sent() -> None:
            handle.close()
            self.sent.append("file")

        return Response(
            status=200,
            file=FileBody(handle, offset, length),
            content_type="application/octet-stream",
            on_sent=sent,
        )

    async def fd(self, request: Request) -> Response:
        assert self.file_path is not None
        offset, length = self._range(request)
        fd = os.open(self.file_path, os.O_RDONLY)

        def sent() -> None:
            os.close(fd)
            self.sent.append("fd")

        return Response(status=200, file=FileBody(fd, offset, length), on_sent=sent)

    async def view(self, request: Request) -> Response:
        size = int(parse_qs(request.query)["size"][0])
        body = bytearray(pattern(size))
        return Response(status=200, body=memoryview(body), on_sent=lambda: self.sent.append("view"))

    async def block(self, request: Request) -> Response:
        self.blocked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class ServerThread:
    """An :class:`HttpServer` on a loopback port, on an event loop in a thread."""

    def __init__(self, app: App, **options: Any) -> None:
        self.app = app
        self.options = options
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        server = HttpServer(handler=self.app, sock=sock, **self.options)
        await server.start()
        self.port = sock.getsockname()[1]
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.close()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10), "the server did not start"

    def stop(self) -> None:
        if self._thread.is_alive():
            assert self._loop is not None
            assert self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
            assert not self._thread.is_alive(), "the server did not stop"

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def raw(self) -> RawClient:
        return RawClient(socket.create_connection(("127.0.0.1", self.port), timeout=10))


class RawClient:
    """A socket and the bytes received on it that no response has consumed yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = b""
        #: From when it is set (time.monotonic()), every wait of this client ends by then: a test
        #: bounds the server's answer and close with it, and a wait past it raises TimeoutError.
        self.deadline: float | None = None

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _until_deadline(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("past the test's deadline")
            self.sock.settimeout(left)

    def _recv(self) -> bytes:
        self._until_deadline()
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers (names lower-cased), body (by its Content-Length)."""
        while b"\r\n\r\n" not in self.pending:
            self.pending += self._recv()
        head, self.pending = self.pending.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {
            name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(self.pending) < length:
            self.pending += self._recv()
        body, self.pending = self.pending[:length], self.pending[length:]
        return status, headers, body

    def closed_by_server(self) -> bool:
        """Whether the server closes the connection (EOF or reset) with nothing more sent."""
        try:
            self._until_deadline()
            return not self.pending and self.sock.recv(65536) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(8 * MiB + 123)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture
def serve(data_file: tuple[Path, bytes]) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(**options: Any) -> ServerThread:
        server = ServerThread(App(data_file[0]), **options)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def post(
    conn: http.client.HTTPConnection, path: str, body: bytes, **headers: str
) -> http.client.HTTPResponse:
    conn.request("POST", path, body=body, headers=headers)
    return conn.getresponse()


def head(method: str, path: str, *headers: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", *headers, "", ""]).encode()


def test_a_32_mib_upload_is_received_into_the_handlers_mmap(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    data = os.urandom(32 * MiB)
    conn = server.connection()
    response = post(conn, "/upload", data)
    assert response.status == 200
    assert json.loads(response.read()) == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    sock = conn.sock
    conn.request("GET", "/ping")
    assert conn.getresponse().read() == b'{"pong": true}'
    assert conn.sock is sock  # still the same connection
    conn.close()


def test_requests_of_every_kind_share_one_keep_alive_connection(
    serve: Callable[..., ServerThread], data_file: tuple[Path, bytes]
) -> None:
    server = serve()
    _, data = data_file
    conn = server.connection()
    conn.request("GET", "/ping")
    assert conn.getresponse().read() == b'{"pong": true}'
    sock = conn.sock
    payload = os.urandom(3 * MiB + 17)
    for _ in range(2):
        response = post(conn, "/upload", payload)
        assert json.loads(response.read())["sha256"] == hashlib.sha256(payload).hexdigest()
        conn.request("GET", f"/file?offset=5&length={2 * MiB}")
        assert conn.getresponse().read() == data[5 : 5 + 2 * MiB]
        conn.request("PUT", "/echo", body=b"small body")
        assert conn.getresponse().read() == b"small body"
        conn.request("GET", "/view?size=100")
        assert conn.getresponse().read() == pattern(100)
        post(conn, "/upload", b"").read()
    assert conn.sock is sock
    conn.close()


def test_a_file_body_is_sent_whole_from_an_offset_and_released(
    serve: Callable[..., ServerThread], data_file: tuple[Path, bytes]
) -> None:
    server = serve()
    _, data = data_file
    conn = server.connection()
    conn.request("GET", f"/file?offset=0&length={len(data)}")
    response = conn.getresponse()
    assert response.getheader("Content-Length") == str(len(data))
    assert response.getheader("Content-Type") == "application/octet-stream"
    assert response.read() == data
    conn.request("GET", f"/fd?offset=1000&length={len(data) - 2000}")
    assert conn.getresponse().read() == data[1000:-1000]
    wait_for(lambda: server.app.sent == ["file", "fd"], timeout=10, what="on_sent of both file bodies")
    conn.close()


def test_a_file_shorter_than_its_file_body_closes_the_connection(
    serve: Callable[..., ServerThread], data_file: tuple[Path, bytes]
) -> None:
    server = serve()
    _, data = data_file
    conn = server.connection()
    conn.request("GET", f"/file?offset={len(data) - 10}&length=100")
    response = conn.getresponse()
    assert response.getheader("Content-Length") == "100"
    with pytest.raises(http.client.IncompleteRead) as caught:
        response.read()
    assert caught.value.partial == data[-10:]
    wait_for(lambda: server.app.sent == ["file"], timeout=10, what="on_sent after the failed send")
    conn.close()
    conn = server.connection()
    conn.request("GET", "/ping")
    assert conn.getresponse().status == 200
    conn.close()


def test_a_memoryview_body_is_sent_whole(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    size = 5 * MiB + 3
    conn = server.connection()
    conn.request("GET", f"/view?size={size}")
    response = conn.getresponse()
    assert response.getheader("Content-Length") == str(size)
    assert response.read() == pattern(size)
    wait_for(lambda: server.app.sent == ["view"], timeout=10, what="on_sent of the memoryview body")
    conn.close()


def test_an_unread_small_body_is_drained_and_the_connection_kept(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    conn = server.connection()
    conn.request("GET", "/ping")
    conn.getresponse().read()
    sock = conn.sock
    response = post(conn, "/ignore", os.urandom(DRAIN_MAX_BYTES))
    assert response.status == 200
    assert response.getheader("Connection") is None
    response.read()
    conn.request("GET", "/ping")
    assert conn.getresponse().read() == b'{"pong": true}'
    assert conn.sock is sock
    conn.close()


def test_an_unread_large_body_closes_the_connection_after_a_readable_answer(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve()
    conn = server.connection()
    response = post(conn, "/ignore", os.urandom(DRAIN_MAX_BYTES * 8))
    assert response.status == 200
    assert response.getheader("Connection") == "close"
    assert json.loads(response.read()) == {"read": False}
    assert conn.sock is None  # http.client closed it, as told
    conn.request("GET", "/ping")  # a new connection
    assert conn.getresponse().status == 200
    conn.close()


def test_a_client_that_closes_in_the_middle_of_a_body_leaves_the_server_serving(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve()
    client = server.raw()
    client.send(head("POST", "/upload", f"Content-Length: {4 * MiB}") + os.urandom(MiB))
    client.sock.shutdown(socket.SHUT_WR)
    assert client.closed_by_server()
    client.close()
    wait_for(lambda: server.app.errors, timeout=10, what="the handler's read to fail")
    assert isinstance(server.app.errors[0], ClientDisconnected)
    conn = server.connection()
    payload = os.urandom(MiB)
    assert json.loads(post(conn, "/upload", payload).read())["sha256"] == hashlib.sha256(payload).hexdigest()
    conn.close()


def test_a_body_shorter_than_its_content_length_times_out(serve: Callable[..., ServerThread]) -> None:
    server = serve(read_timeout_s=0.5)
    for path in ("/upload", "/echo", "/ignore"):
        method = "PUT" if path == "/echo" else "POST"
        client = server.raw()
        client.deadline = time.monotonic() + 5
        client.send(head(method, path, "Content-Length: 1000") + b"x" * 600)
        if path == "/ignore":  # the server tries to drain the rest, then gives up without an answer
            status, headers, _ = client.response()
            assert (status, headers["connection"]) == (200, "close")
        else:
            status, headers, body = client.response()
            assert (status, headers["connection"]) == (408, "close")
            assert json.loads(body)["error"] == "RequestTimeout"
        assert client.closed_by_server()
        client.close()
    assert [type(exc) for exc in server.app.errors] == [TimeoutError]
    conn = server.connection()
    conn.request("GET", "/ping")
    assert conn.getresponse().status == 200
    conn.close()


def test_a_body_that_trickles_in_is_cut_at_its_deadline(serve: Callable[..., ServerThread]) -> None:
    # 1,000 bytes at 1,000 bytes/s after a base of 0.5 s: due 1.5 s after the first read, well
    # before the 5 s without a byte that would end it otherwise.
    server = serve(read_timeout_s=5, body_deadline_base_s=0.5, body_min_rate_bytes_per_s=1000)
    client = server.raw()
    client.deadline = time.monotonic() + 30
    client.send(head("POST", "/upload", "Content-Length: 1000") + b"x" * 10)
    status, headers, body = client.response()
    assert (status, headers["connection"]) == (408, "close")
    assert "did not arrive within its deadline" in json.loads(body)["message"]
    assert client.closed_by_server()
    client.close()
    assert [type(exc) for exc in server.app.errors] == [BodyDeadlineExceeded]


def test_a_body_longer_than_its_content_length_makes_a_bad_next_request(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve()
    client = server.raw()
    client.send(head("PUT", "/echo", "Content-Length: 5") + b"hello, and more\r\n\r\n")
    assert client.response()[2] == b"hello"
    status, headers, body = client.response()
    assert (status, headers["connection"]) == (400, "close")
    assert "malformed request line" in json.loads(body)["message"]
    assert client.closed_by_server()
    client.close()


def test_pipelined_requests_are_answered_in_order(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    client = server.raw()
    payload = os.urandom(100_000)
    client.send(
        head("POST", "/upload", f"Content-Length: {len(payload)}")
        + payload
        + head("PUT", "/echo", "Content-Length: 3")
        + b"abc"
        + head("GET", "/ping")
    )
    assert json.loads(client.response()[2])["sha256"] == hashlib.sha256(payload).hexdigest()
    assert client.response()[2] == b"abc"
    assert client.response()[2] == b'{"pong": true}'
    client.close()


def test_chunked_bodies_are_read_whole_but_refused_for_streaming(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    client = server.raw()
    chunked = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nTrailer: x\r\n\r\n"
    client.send(head("PUT", "/echo", "Transfer-Encoding: chunked") + chunked)
    assert client.response()[:3:2] == (200, b"hello, world")
    client.send(head("POST", "/upload", "Transfer-Encoding: chunked") + chunked)
    status, headers, body = client.response()
    assert (status, headers["connection"]) == (411, "close")
    assert json.loads(body)["error"] == "LengthRequired"
    client.close()


def test_bodies_over_the_read_body_limit_get_413(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    conn = server.connection()
    conn.request("PUT", "/echo", body=os.urandom(2 * MiB))
    response = conn.getresponse()
    assert (response.status, response.getheader("Connection")) == (413, "close")
    assert json.loads(response.read())["error"] == "RequestEntityTooLarge"
    conn.close()
    client = server.raw()
    chunk = b"%x\r\n" % MiB + bytes(MiB) + b"\r\n"
    client.send(head("PUT", "/echo", "Transfer-Encoding: chunked") + chunk * 2 + b"0\r\n\r\n")
    assert client.response()[0] == 413
    client.close()


def test_expect_100_continue_is_answered_when_the_handler_reads(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    client = server.raw()
    client.send(head("PUT", "/echo", "Content-Length: 4", "Expect: 100-continue"))
    assert client.response()[0] == 100
    client.send(b"body")
    assert client.response()[:3:2] == (200, b"body")
    # A handler that answers without reading: no 100 Continue, and the body is never awaited.
    client.send(head("POST", "/ignore", "Content-Length: 4", "Expect: 100-continue"))
    status, headers, _ = client.response()
    assert (status, headers["connection"]) == (200, "close")
    client.close()


def test_a_request_head_over_the_limit_gets_431(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    client = server.raw()
    client.send(head("GET", "/ping", "X-Big: " + "a" * MAX_HEADER_BYTES))
    status, headers, _ = client.response()
    assert (status, headers["connection"]) == (431, "close")
    assert client.closed_by_server()
    client.close()
    client = server.raw()
    client.send(head("GET", "/ping", "X-Big: " + "a" * (MAX_HEADER_BYTES - 100)))
    assert client.response()[0] == 200
    client.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /ping SPDY/3\r\n\r\n",
        b"GET /ping HTTP/1.1\r\nno colon\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: 1x\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        # Content-Length in its one spelling only, within int64 (5,000 digits: no dropped task).
        b"POST /upload HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: 9223372036854775808\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: 1_0\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: 05\r\n\r\n",
        b"POST /upload HTTP/1.1\r\nContent-Length: \xd9\xa3\r\n\r\n",
        b"PUT /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n",
        b"PUT /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
        b"PUT /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 5000 + b"\r\n",
    ],
)
def test_malformed_requests_get_400(serve: Callable[..., ServerThread], request_bytes: bytes) -> None:
    server = serve()
    client = server.raw()
    client.send(request_bytes)
    status, headers, _ = client.response()
    assert (status, headers["connection"]) == (400, "close")
    assert client.closed_by_server()
    client.close()


def test_idle_connections_are_closed_after_the_idle_timeout(serve: Callable[..., ServerThread]) -> None:
    server = serve(idle_timeout_s=0.3)
    client = server.raw()
    client.send(head("GET", "/ping"))
    assert client.response()[0] == 200
    client.deadline = time.monotonic() + 5
    assert client.closed_by_server()
    client.close()


def test_an_answer_may_keep_its_connection_longer_than_the_idle_timeout(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve(idle_timeout_s=0.3)
    kept = server.raw()
    kept.send(head("GET", "/keep"))
    assert kept.response()[0] == 200
    plain = server.raw()  # answered after the kept one: its idle time starts later
    plain.send(head("GET", "/ping"))
    assert plain.response()[0] == 200
    plain.deadline = time.monotonic() + 5
    assert plain.closed_by_server()
    plain.close()
    # Idle longer than the server's timeout, and still served; the next answer does not keep it.
    kept.deadline = time.monotonic() + 5
    kept.send(head("GET", "/ping"))
    assert kept.response()[0] == 200
    assert kept.closed_by_server()
    kept.close()


def test_the_agent_keeps_the_control_planes_greeting_connection_past_its_idle_timeout() -> None:
    """``GET /health`` with the node's control-plane token is the control plane's greeting: the
    agent keeps that connection for its pushes (contracts/agent_api.py, AGENT_PUSH_IDLE_S).
    Health stays open to anyone, and any other caller's connection closes when idle."""
    state = AgentState(cluster="c")
    state.mark_registered(
        node_id="i-1",
        cluster_token=SecretStr("cluster-token"),
        node_token=SecretStr("node-token"),
        control_plane_token=SecretStr("control-plane-token"),
    )
    server = ServerThread(AgentApp(state=state), idle_timeout_s=0.3)
    server.start()
    try:
        greeting = server.raw()
        greeting.send(head("GET", "/health", "Authorization: Bearer control-plane-token"))
        assert greeting.response()[0] == 200
        for headers in [(), ("Authorization: Bearer cluster-token",), ("Authorization: Bearer wrong",)]:
            client = server.raw()
            client.send(head("GET", "/health", *headers))
            assert client.response()[0] == 200  # answered: health is open
            client.deadline = time.monotonic() + 5
            assert client.closed_by_server()
            client.close()
        # Idle past the server's timeout (after the others, which were answered later), and still
        # served: the control plane's next push goes over it.
        greeting.deadline = time.monotonic() + 5
        greeting.send(head("GET", "/health"))
        status, _, body = greeting.response()
        assert (status, json.loads(body)["node_id"]) == (200, "i-1")
        greeting.close()
    finally:
        server.stop()


def test_shutdown_closes_idle_and_busy_connections(serve: Callable[..., ServerThread]) -> None:
    server = serve()
    idle = server.raw()
    idle.send(head("GET", "/ping"))
    assert idle.response()[0] == 200
    busy = server.raw()
    busy.send(head("GET", "/block"))
    assert server.app.blocked.wait(10)
    idle.deadline = busy.deadline = time.monotonic() + 5
    server.stop()
    assert idle.closed_by_server()
    assert busy.closed_by_server()
    idle.close()
    busy.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)


def test_a_connection_reset_in_the_middle_of_a_streamed_body_fails_the_read(
    serve: Callable[..., ServerThread],
) -> None:
    server = serve()
    client = server.raw()
    client.send(head("POST", "/upload", f"Content-Length: {64 * MiB}") + os.urandom(4 * MiB))
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # with SO_LINGER 0: a reset, not an EOF
    wait_for(lambda: server.app.errors, timeout=10, what="the handler's read to fail")
    assert isinstance(server.app.errors[0], ConnectionError)


@pytest.mark.parametrize("path", ["/view?size=33554432", f"/file?offset=0&length={8 * MiB}"])
def test_a_client_that_does_not_read_the_answer_is_cut_off_after_the_write_timeout(
    serve: Callable[..., ServerThread], path: str
) -> None:
    server = serve(write_timeout_s=0.5)
    client = server.raw()
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    client.send(head("GET", path))
    route = path[1:].split("?")[0]
    wait_for(lambda: server.app.sent == [route], timeout=10, what="the server to give up on the answer")
    client.close()
    conn = server.connection()
    conn.request("GET", "/ping")
    assert conn.getresponse().status == 200
    conn.close()
