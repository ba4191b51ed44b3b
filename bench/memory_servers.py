"""The helper servers of ``memory_tier.py``, each run as a mode of that script in its own process:
the reference (``--reference-server PORT``: the afternoon version of the protocol, a dict under
FastAPI), the raw HTTP floor (``--raw-server PORT``: the least a server can do for the library) and
the loopback ceiling's receiver (``--ceiling-receiver PORT``), with the ceiling's sender."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
from typing import Any

# At module level: FastAPI resolves the handlers' (string, see __future__) annotations here.
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from bench.common import HOST, recv_exactly

STEPS_RETAINED = 3  # what the library's client asks every server to keep per rank
ACK = b"\x01"
LENGTH = struct.Struct("!Q")


# ---------------------------------------------------------------------- the reference server


def reference_app() -> Any:
    """The naive server: one dict, the routes the library's client calls, nothing more."""
    app = FastAPI()
    # namespace -> {"num_ranks", "steps_retained", "shards": {rank: {step: (bytes, Shard-Meta)}}}
    namespaces: dict[str, dict[str, Any]] = {}

    def not_found(what: str) -> JSONResponse:
        return JSONResponse({"error": "NotFound", "message": f"{what} not found"}, status_code=404)

    @app.get("/v1/cp/namespaces/{ns}")
    async def get_namespace(ns: str) -> Any:
        if ns not in namespaces:
            return not_found(f"namespace {ns}")
        found = namespaces[ns]
        return {"num_ranks": found["num_ranks"], "steps_to_retain_per_rank": found["steps_retained"]}

    @app.post("/v1/cp/namespaces/{ns}")
    async def create_namespace(ns: str, num_ranks: int, steps_retained: int = 3) -> Any:
        if ns in namespaces:
            return JSONResponse({"error": "Conflict", "message": f"{ns} exists"}, status_code=409)
        namespaces[ns] = {"num_ranks": num_ranks, "steps_retained": steps_retained, "shards": {}}
        return JSONResponse({"namespace": ns, "num_ranks": num_ranks}, status_code=201)

    @app.delete("/v1/cp/namespaces/{ns}")
    async def delete_namespace(ns: str) -> Any:
        if namespaces.pop(ns, None) is None:
            return not_found(f"namespace {ns}")
        return {"deleted": ns}

    @app.get("/v1/cp/checkpoints/{ns}/latest")
    async def latest(ns: str, limit: int = 5) -> Any:
        if ns not in namespaces:
            return not_found(f"namespace {ns}")
        found = namespaces[ns]
        by_rank: dict[int, dict[int, Any]] = found["shards"]
        steps = {step for held in by_rank.values() for step in held}
        complete = [s for s in steps if all(s in by_rank.get(r, {}) for r in range(found["num_ranks"]))]
        return sorted(complete, reverse=True)[:limit]

    @app.post("/v1/cp/checkpoints/{ns}/{rank}/{step}")
    async def put_shard(ns: str, rank: int, step: int, request: Request) -> Any:
        if ns not in namespaces:
            return not_found(f"namespace {ns}")
        body = await request.body()
        held = namespaces[ns]["shards"].setdefault(rank, {})
        held[step] = (body, request.headers.get("shard-meta", "{}"))
        for old in sorted(held)[: -namespaces[ns]["steps_retained"]]:
            del held[old]
        return {"namespace": ns, "rank": rank, "step": step, "size": len(body)}

    @app.get("/v1/cp/checkpoints/{ns}/{rank}/{step}")
    async def get_shard(ns: str, rank: int, step: int) -> Any:
        found = namespaces.get(ns, {}).get("shards", {}).get(rank, {}).get(step)
        if found is None:
            return not_found(f"shard {ns}/{rank}/{step}")
        body, meta = found
        return Response(content=body, media_type="application/octet-stream", headers={"Shard-Meta": meta})

    @app.delete("/v1/cp/checkpoints/{ns}/{rank}/{step}")
    async def delete_shard(ns: str, rank: int, step: int) -> Any:
        held = namespaces.get(ns, {}).get("shards", {}).get(rank, {})
        if held.pop(step, None) is None:
            return not_found(f"shard {ns}/{rank}/{step}")
        return {"deleted": {"rank": rank, "step": step}}

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    return app


def run_reference_server(port: int) -> int:
    import uvicorn

    uvicorn.run(reference_app(), host=HOST, port=port, log_level="warning")
    return 0


# ---------------------------------------------------------------------- the ceiling


def run_ceiling_receiver(port: int, max_bytes: int) -> int:
    """Receive ``length`` + bytes into one preallocated, pre-touched buffer; answer one byte."""
    buffer = bytearray(max_bytes)
    view = memoryview(buffer)
    for offset in range(0, max_bytes, 4096):
        view[offset] = 1  # fault every page in before any timing
    header = memoryview(bytearray(LENGTH.size))
    with socket.create_server((HOST, port)) as server:
        print("ceiling receiver ready", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                try:
                    while True:
                        recv_exactly(conn, header)
                        (length,) = LENGTH.unpack(header)
                        recv_exactly(conn, view[:length])
                        conn.sendall(ACK)
                except ConnectionError:
                    continue


def measure_ceiling(port: int, payloads: dict[int, bytes], repeats: int) -> dict[int, list[float]]:
    """Seconds per round (send size bytes, receive the ack), per size; one untimed round first."""
    results: dict[int, list[float]] = {}
    with socket.create_connection((HOST, port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = bytearray(1)
        for size, payload in payloads.items():
            rounds: list[float] = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                conn.sendall(LENGTH.pack(len(payload)))
                conn.sendall(payload)
                if conn.recv_into(ack) != 1:
                    raise ConnectionError("ceiling receiver closed")
                if i:
                    rounds.append(time.perf_counter() - start)
            results[size] = rounds
    return results


# ---------------------------------------------------------------------- the floor: raw HTTP

SMALL_BODY = 1024 * 1024
SLICE = 1024 * 1024


def _http_head(status: str, length: int, extra: str = "", content_type: str = "application/json") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode("latin-1")


def run_raw_http_server(port: int, max_bytes: int) -> int:
    """The least work a server can do for the library: HTTP/1.1 over blocking sockets, a large body
    ``recv_into`` one preallocated, pre-touched buffer (only the last large shard is kept), small
    bodies (the metadata rank) in a dict, GET answered with ``sendall`` from the buffer; every
    namespace exists; no checks. Only the routes the benchmark uses."""
    import threading

    big = bytearray(max_bytes)
    view = memoryview(big)
    for offset in range(0, max_bytes, 4096):
        view[offset] = 1
    held: dict[str, Any] = {"key": None, "length": 0, "meta": ""}
    small: dict[str, tuple[bytes, str]] = {}
    namespace_doc = json.dumps({"num_ranks": 2, "steps_to_retain_per_rank": STEPS_RETAINED}).encode()

    def respond(conn: socket.socket, status: str, body: bytes | memoryview, extra: str = "") -> None:
        octets = "application/octet-stream" if extra else "application/json"
        head = _http_head(status, len(body), extra, octets)
        if len(body) <= SLICE:
            conn.sendall(head + bytes(body))
            return
        conn.sendall(head)
        for offset in range(0, len(body), SLICE):
            conn.sendall(body[offset : offset + SLICE])

    def handle(conn: socket.socket) -> None:
        pending = b""
        with conn, contextlib.suppress(ConnectionError):
            while True:
                while b"\r\n\r\n" not in pending:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    pending += chunk
                head, _, rest = pending.partition(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)
                }
                length = int(headers.get("content-length", "0"))
                parts = target.split("?")[0].strip("/").split("/")
                body: bytes | None = None
                if length > SMALL_BODY:
                    taken = min(len(rest), length)
                    view[:taken] = rest[:taken]
                    recv_exactly(conn, view[taken:length])
                    pending = rest[taken:]
                else:
                    while len(rest) < length:
                        rest += conn.recv(65536)
                    body, pending = rest[:length], rest[length:]
                key = "/".join(parts[3:6]) if len(parts) == 6 else ""  # namespace/rank/step
                if parts[:3] == ["v1", "cp", "namespaces"]:
                    respond(conn, "200 OK", namespace_doc if method == "GET" else b"{}")
                elif parts[:3] == ["v1", "cp", "checkpoints"] and key and method == "POST":
                    meta = headers.get("shard-meta", "{}")
                    if body is None:
                        held.update(key=key, length=length, meta=meta)
                    else:
                        small[key] = (body, meta)
                    respond(conn, "200 OK", b"{}")
                elif parts[:3] == ["v1", "cp", "checkpoints"] and key and method == "GET":
                    if held["key"] == key:
                        respond(conn, "200 OK", view[: held["length"]], f"Shard-Meta: {held['meta']}\r\n")
                    elif key in small:
                        data, meta = small[key]
                        respond(conn, "200 OK", data, f"Shard-Meta: {meta}\r\n")
                    else:
                        respond(conn, "404 Not Found", b'{"error": "NotFound"}')
                else:
                    respond(conn, "404 Not Found", b'{"error": "NotFound"}')

    with socket.create_server((HOST, port)) as server:
        print("raw HTTP server ready", flush=True)
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio does
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
