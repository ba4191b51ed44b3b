"""The agents' HTTP client (hyperpod_sim/agents/http/client.py, aiohttp): against real servers on
loopback, what a caller sees of answers, refusals and peers that stop reading."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator

import pytest

from hyperpod_sim.agents.http.client import HttpClient, HttpError
from hyperpod_sim.agents.http.server import HttpServer, Request, Response
from tests.conftest import free_port


async def _serve(handle: object) -> tuple[HttpServer, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = HttpServer(handler=handle, sock=sock)  # type: ignore[arg-type]
    await server.start()
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_calls_go_over_one_kept_connection_and_answers_come_whole() -> None:
    async def handle(request: Request) -> Response:
        body = await request.read_body()
        return Response(status=201, body=body[::-1], headers=(("X-Seen", str(len(body))),))

    async def scenario() -> list[tuple[int, bytes, str]]:
        server, url = await _serve(handle)
        client = HttpClient(timeout=5)
        try:
            answers = [await client.put(f"{url}/x", content=b"abc" * n) for n in range(1, 6)]
            connections = len(server.connections)
        finally:
            await client.aclose()
            await server.close()
        assert connections == 1  # five calls, one connection
        return [(a.status_code, a.content, a.headers["x-seen"]) for a in answers]

    assert asyncio.run(scenario()) == [(201, (b"abc" * n)[::-1], str(3 * n)) for n in range(1, 6)]


def test_a_refused_connection_and_a_silent_peer_are_errors_not_hangs() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # accepts, never answers

    async def scenario() -> list[str]:
        client = HttpClient(timeout=0.5)
        errors = []
        try:
            for url in (
                f"http://127.0.0.1:{free_port()}/x",
                f"http://127.0.0.1:{listener.getsockname()[1]}/x",
            ):
                with pytest.raises(HttpError) as raised:
                    await client.get(url)
                errors.append(str(raised.value))
        finally:
            await client.aclose()
        return errors

    try:
        refused, silent = asyncio.run(scenario())
    finally:
        listener.close()
    assert "Cannot connect" in refused
    assert "Timeout" in silent


def test_an_upload_to_a_peer_that_stops_reading_fails_within_its_deadline() -> None:
    # A peer frozen mid-upload (SIGSTOP, a partition): it accepts the connection and reads nothing.
    # 8 MiB fill the socket buffers, and the write waits: the client gives up after its read
    # timeout plus the body's length at the slowest rate allowed (1 MiB/s: 8 s), never later.
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    body = bytes(8 * 1024 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(body), 1024 * 1024):
            yield body[at : at + 1024 * 1024]

    async def scenario() -> float:
        client = HttpClient(timeout=0.5)
        started = time.monotonic()
        try:
            with pytest.raises(HttpError):
                await client.put(
                    f"http://127.0.0.1:{listener.getsockname()[1]}/x",
                    content=chunks(),
                    headers={"Content-Length": str(len(body))},
                )
            return time.monotonic() - started
        finally:
            await client.aclose()

    try:
        took = asyncio.run(scenario())
    finally:
        stop.set()
        thread.join()
        for sock in accepted:
            sock.close()
        listener.close()
    assert took < 0.5 + 0.5 + 8 + 30  # its deadline (9 s), with room for a loaded machine
