"""A stand-in control plane for an agent's client: real HTTP on a loopback port, each request
answered by a function of the test's (given the request: its method, path and headers), in the
test's event loop."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from hyperpod_sim.agents.http.server import DropConnection, HttpServer, Request, Response


@dataclass(frozen=True)
class Canned:
    """An answer: a status and a JSON body (or a text one)."""

    status: int
    json: Any = None
    text: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def response(self) -> Response:
        if self.text is not None:
            body, content_type = self.text.encode(), "text/plain"
        else:
            body, content_type = json.dumps(self.json).encode(), "application/json"
        return Response(status=self.status, body=body, content_type=content_type, headers=self.headers)


class Drop:
    """No answer: the connection is closed as the request arrives (what a client sees of a
    control plane that is down or cut off)."""


DROP = Drop()

Answer = Callable[[Request], Canned | Drop]


@asynccontextmanager
async def standin(answer: Answer) -> AsyncIterator[str]:
    """Serve ``answer(request)`` for every request; the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    async def handle(request: Request) -> Response:
        await request.read_body()
        reply = answer(request)
        if isinstance(reply, Drop):
            raise DropConnection("the stand-in drops this request")
        return reply.response()

    server = HttpServer(handler=handle, sock=sock)
    await server.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await server.close()
        sock.close()
