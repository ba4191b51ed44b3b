"""Agent HTTP server throughput on large bodies, against the loopback ceiling.

Usage::

    python bench/agent_http.py [--mib 256] [--runs 5] [--json out.json]

Two servers, each in its own process on a loopback port, each with one preallocated, pre-touched
buffer of ``--mib`` MiB (an anonymous mmap) and a file of the same size in /dev/shm (tmpfs, like the
checkpoint tier's shared-memory shards):

* agent: ``agents.httpserver.HttpServer``. ``POST /sink`` streams the body into the mmap with
  ``request.readinto``; ``GET /file`` answers a ``FileBody`` of the shm file (``loop.sendfile``);
  ``GET /view`` answers a ``memoryview`` of the mmap.
* raw: the ceiling. A blocking socket server speaking a 9-byte binary header (operation, length):
  upload is ``recv_into`` the mmap until the length arrived, then a 1-byte ack; download is
  ``sendall`` of the mmap in 1 MiB slices (the fastest here: one ``sendall`` of the whole buffer,
  also measured, is about 1.5x slower on loopback), or ``socket.sendfile`` of the shm file.

The client is this process, the same code for both: one connection per server, the body sent with
one ``sendall`` of a preallocated ``bytes``, downloads received with ``recv_into`` a preallocated
buffer. Each cell runs once untimed with its data checked (SHA-256 on the server for uploads, a
comparison here for downloads), then ``--runs`` times timed, the cells interleaved: from the first
byte sent to the last byte of the answer received. The server's CPU time (``/proc``) is read around
each run. On a machine with two CPUs or more, the servers
run on one CPU and the client on another. MiB/s is size / median time; the ratio is agent / raw.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # agents, bench.common

from bench.common import HOST, MIB, cpu_seconds, recv_exactly, write_json

HEADER = struct.Struct("!cQ")  # raw protocol: operation (U, V: upload; D, W, F: download), length

UPLOAD_AGENT = "upload   agent POST readinto(mmap)"
UPLOAD_RAW = "upload   raw recv_into(mmap)"
GET_FILE = "download agent GET FileBody (sendfile)"
GET_VIEW = "download agent GET memoryview body"
RAW_SEND = "download raw sendall(mmap), 1 MiB slices"
RAW_SEND_WHOLE = "download raw sendall(mmap), one call"
RAW_SENDFILE = "download raw socket.sendfile(shm file)"


def pin(cpu: int) -> None:
    """Run on one CPU (servers on the first, the client on the second) when the machine has two."""
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu]})


def touched_mmap(size: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, size)
    buffer.write(bytes(size))  # first touch now, not during the measurement
    return buffer


def agent_server(size: int, path: str, conn: multiprocessing.connection.Connection) -> None:
    import asyncio

    from hyperpod_sim.agents.http.server import FileBody, HttpServer, Request, Response, json_response

    pin(0)
    buffer = touched_mmap(size)
    view = memoryview(buffer)
    file = open(path, "rb")  # noqa: SIM115 (for the life of the process)

    async def handler(request: Request) -> Response:
        if request.method == "POST" and request.path == "/sink":
            length = request.content_length
            if length is None or length > size:
                return json_response(413, {"error": "too large"})
            await request.readinto(view[:length])
            digest = hashlib.sha256(view[:length]).hexdigest() if request.query == "verify" else ""
            return json_response(200, {"size": length, "sha256": digest})
        if request.path == "/file":
            return Response(status=200, file=FileBody(file, 0, size), content_type="application/octet-stream")
        if request.path == "/view":
            return Response(status=200, body=view, content_type="application/octet-stream")
        return json_response(404, {"error": "no route"})

    async def serve() -> None:
        sock = socket.socket()
        sock.bind((HOST, 0))
        sock.setblocking(False)
        server = HttpServer(handler=handler, sock=sock, read_timeout_s=60, write_timeout_s=60)
        await server.start()
        conn.send(sock.getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
        await server.close()

    asyncio.run(serve())


def raw_server(size: int, path: str, conn: multiprocessing.connection.Connection) -> None:
    pin(0)
    buffer = touched_mmap(size)
    view = memoryview(buffer)
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen()
    conn.send(listener.getsockname()[1])
    client, _ = listener.accept()
    with client, open(path, "rb") as file:
        while True:
            header = client.recv(HEADER.size, socket.MSG_WAITALL)
            if len(header) < HEADER.size:
                return
            op, length = HEADER.unpack(header)
            if op in (b"U", b"V"):
                received = 0
                while received < length:
                    n = client.recv_into(view[received:length])
                    if not n:
                        return
                    received += n
                client.sendall(hashlib.sha256(view[:length]).digest() if op == b"V" else b"k")
            elif op == b"D":  # in slices: faster than one sendall of the whole buffer (cache locality)
                for start in range(0, length, MIB):
                    client.sendall(view[start : min(start + MIB, length)])
            elif op == b"W":
                client.sendall(view[:length])
            elif op == b"F":
                client.sendfile(file, 0, length)


def start(
    target: Callable[[int, str, multiprocessing.connection.Connection], None], size: int, path: str
) -> tuple[multiprocessing.process.BaseProcess, int, multiprocessing.connection.Connection]:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(size, path, child), daemon=True)
    process.start()
    if not parent.poll(60):
        raise RuntimeError(f"{target.__name__} did not start")
    return process, parent.recv(), parent


class HttpClient:
    """Raw HTTP/1.1 on one keep-alive connection: no client library between the bytes and the clock."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port))
        self.pending = bytearray()

    def response_head(self) -> tuple[int, int]:
        """Status and Content-Length of the next response."""
        while b"\r\n\r\n" not in self.pending:
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self.pending += data
        end = self.pending.index(b"\r\n\r\n")
        lines = self.pending[:end].decode("latin-1").split("\r\n")
        del self.pending[: end + 4]
        fields = {
            name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])
        }
        return int(lines[0].split(" ")[1]), int(fields["content-length"])

    def body_into(self, into: memoryview) -> None:
        have = min(len(self.pending), len(into))
        into[:have] = self.pending[:have]
        del self.pending[:have]
        recv_exactly(self.sock, into[have:])


@dataclass
class Cell:
    name: str
    mib_per_s: float
    best_mib_per_s: float
    server_cpu_s_per_gib: float
    times_s: list[float]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``; 0 elsewhere, so that the
    CPU column reads 0 rather than failing)."""
    seconds = cpu_seconds(pid)
    return 0.0 if seconds is None else seconds


def measure(size: int, runs: int, cells: dict[str, tuple[Callable[[], object], int]]) -> list[Cell]:
    """Each cell (what to run once, the server's pid) ``runs`` times, interleaved (one run of each per
    round), so that a slow spell of the machine hits all cells alike."""
    times: dict[str, list[float]] = {name: [] for name in cells}
    cpu: dict[str, float] = dict.fromkeys(cells, 0.0)
    for _ in range(runs):
        for name, (once, pid) in cells.items():
            cpu_before = cpu_s(pid)
            started = time.perf_counter()
            once()
            times[name].append(time.perf_counter() - started)
            cpu[name] += cpu_s(pid) - cpu_before
    mib = size / MIB
    gib_total = size * runs / (1024 * MIB)
    return [
        Cell(name, mib / statistics.median(t), mib / min(t), cpu[name] / gib_total, t)
        for name, t in times.items()
    ]


def run(size: int, runs: int, shm_path: str, payload: bytes) -> list[Cell]:
    sha = hashlib.sha256(payload).digest()
    received = bytearray(size)
    into = memoryview(received)
    agent, agent_port, agent_pipe = start(agent_server, size, shm_path)
    raw, raw_port, _ = start(raw_server, size, shm_path)
    agent_pid, raw_pid = agent.pid or 0, raw.pid or 0
    try:
        pin(1)
        http = HttpClient(agent_port)
        stream = socket.create_connection((HOST, raw_port))

        def agent_upload(query: str = "") -> bytes:
            http.sock.sendall(
                f"POST /sink{query} HTTP/1.1\r\nHost: bench\r\nContent-Length: {size}\r\n\r\n".encode()
            )
            http.sock.sendall(payload)
            status, length = http.response_head()
            answer = bytearray(length)
            http.body_into(memoryview(answer))
            assert status == 200, status
            return bytes(answer)

        def agent_get(path: str) -> None:
            http.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
            assert http.response_head() == (200, size)
            http.body_into(into)

        def raw_upload(op: bytes = b"U") -> bytes:
            stream.sendall(HEADER.pack(op, size))
            stream.sendall(payload)
            return stream.recv(32 if op == b"V" else 1, socket.MSG_WAITALL)

        def raw_get(op: bytes) -> None:
            stream.sendall(HEADER.pack(op, size))
            recv_exactly(stream, into)

        # Untimed runs whose bytes are checked.
        assert json.loads(agent_upload("?verify"))["sha256"] == sha.hex(), "the agent received other bytes"
        assert raw_upload(b"V") == sha, "the raw server received other bytes"
        for path_or_op in ("/file", "/view", b"F", b"D"):  # the agent's mmap holds the payload now
            received[:] = bytes(size)
            if isinstance(path_or_op, str):
                agent_get(path_or_op)
            else:
                raw_get(path_or_op)
            assert received == payload, f"download {path_or_op!r} returned other bytes"

        cells = measure(
            size,
            runs,
            {
                UPLOAD_AGENT: (agent_upload, agent_pid),
                UPLOAD_RAW: (raw_upload, raw_pid),
                GET_FILE: (lambda: agent_get("/file"), agent_pid),
                GET_VIEW: (lambda: agent_get("/view"), agent_pid),
                RAW_SEND: (lambda: raw_get(b"D"), raw_pid),
                RAW_SEND_WHOLE: (lambda: raw_get(b"W"), raw_pid),
                RAW_SENDFILE: (lambda: raw_get(b"F"), raw_pid),
            },
        )
        http.sock.close()
        stream.close()
        return cells
    finally:
        agent_pipe.send("stop")
        for process in (agent, raw):
            process.join(10)
            if process.is_alive():
                process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="body size (default 256)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per cell (default 5)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    size = args.mib * MIB
    payload = os.urandom(MIB) * args.mib
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=shm_dir, prefix="agent-http-bench-") as shm:
        shm.write(payload)
        shm.flush()
        cells = run(size, args.runs, shm.name, payload)

    python = sys.version.split()[0]
    print(f"{args.mib} MiB x {args.runs} runs per cell, loopback, {os.cpu_count()} CPUs, Python {python}")
    print(f"{'cell':42} {'MiB/s (median)':>15} {'MiB/s (best)':>13} {'server CPU s/GiB':>17}")
    for cell in cells:
        speeds = f"{cell.mib_per_s:15.0f} {cell.best_mib_per_s:13.0f}"
        print(f"{cell.name:42} {speeds} {cell.server_cpu_s_per_gib:17.3f}")
    speed = {cell.name: cell.mib_per_s for cell in cells}
    ratios = {
        "upload (readinto vs recv_into)": speed[UPLOAD_AGENT] / speed[UPLOAD_RAW],
        "download (FileBody vs raw socket.sendfile)": speed[GET_FILE] / speed[RAW_SENDFILE],
        "download (FileBody vs raw sendall slices)": speed[GET_FILE] / speed[RAW_SEND],
        "download (memoryview vs raw sendall slices)": speed[GET_VIEW] / speed[RAW_SEND],
    }
    for name, ratio in ratios.items():
        print(f"ratio agent/raw {name:46} {ratio:.2f}")
    if args.json:
        write_json(args.json, {"cells": [asdict(c) for c in cells], "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
