"""The agents' HTTP client (aiohttp, agents/http/client.py) against httpx, which the agents used
before: CPU per call, and a fan-out to every agent of a large cluster.

Usage::

    python bench/agent_client.py [--calls 3000] [--peers 1023] [--runs 3] [--json out.json]

A helper process serves, with the agents' own HTTP server (agents/http/server.py), a small JSON
answer (a namespace index's size) on ``--peers`` loopback ports. This process is the client, the
same calls through each library in turn, each client made once and warmed up with 200 calls first:

* **sequential**: ``--calls`` GETs one after another on one kept connection, as a `latest` asks a
  home and a heartbeat goes to the control plane: the client's CPU time per call (this process's
  user + system time, ``os.times``), and the wall time per call.
* **fan-out**: one GET to each of the ``--peers`` ports at once, at most 64 connections open (the
  agents' limit), as a home that makes its view whole asks every other agent: the wall time and
  the client's CPU time of the whole fan-out.

Each cell is run ``--runs`` times, the libraries interleaved; the medians are reported. Ratios:
aiohttp / httpx client CPU per sequential call (target <= 0.25x), and aiohttp / httpx fan-out CPU
(target <= 0.25x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import progress, table, with_notes
from bench.runner import BenchRun, Cell, Target, finish

BODY = b'{"steps": [1], "world_sizes": {"1": 1024}}'
PATH = "/v1/internal/catalog/ns?num_ranks=1025"
WINDOW = 64  # the agents' connections to other agents (agents/cluster.py)


def serve(ports_file: str, peers: int) -> None:
    """The helper: the agents' HTTP server on ``peers`` ports; their numbers written to a file."""
    from hyperpod_sim.agents.http.server import HttpServer, Request, Response

    async def handle(request: Request) -> Response:
        await request.read_body()
        return Response(status=200, body=BODY)

    async def main() -> None:
        servers, ports = [], []
        for _ in range(peers):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            server = HttpServer(handler=handle, sock=sock)
            await server.start()
            servers.append(server)
            ports.append(sock.getsockname()[1])
        Path(ports_file + ".tmp").write_text(" ".join(map(str, ports)))
        os.rename(ports_file + ".tmp", ports_file)
        await asyncio.Event().wait()

    asyncio.run(main())


def cpu() -> float:
    times = os.times()
    return times.user + times.system


class Httpx:
    name = "httpx"

    def __init__(self) -> None:
        import httpx

        from hyperpod_sim.agents.http import tls

        # As the agents made theirs (agents/cluster.py before this client).
        self.client = httpx.AsyncClient(
            timeout=10.0,
            trust_env=False,
            verify=tls.client_context(),
            limits=httpx.Limits(max_connections=WINDOW),
        )

    async def get(self, url: str) -> int:
        response = await self.client.get(url, headers={"Authorization": "Bearer x"})
        return len(response.content)

    async def close(self) -> None:
        await self.client.aclose()


class Aiohttp:
    name = "aiohttp"

    def __init__(self) -> None:
        from hyperpod_sim.agents.http.client import HttpClient

        self.client = HttpClient(timeout=10.0, limit=WINDOW)

    async def get(self, url: str) -> int:
        answer = await self.client.get(url, headers={"Authorization": "Bearer x"})
        return len(answer.content)

    async def close(self) -> None:
        await self.client.aclose()


async def sequential(client: Httpx | Aiohttp, url: str, calls: int) -> tuple[float, float]:
    """(CPU s per call, wall s per call)."""
    for _ in range(200):
        assert await client.get(url) == len(BODY)
    started, used = time.perf_counter(), cpu()
    for _ in range(calls):
        await client.get(url)
    return (cpu() - used) / calls, (time.perf_counter() - started) / calls


async def fan_out(client: Httpx | Aiohttp, urls: list[str]) -> tuple[float, float]:
    """(CPU s, wall s) of one GET to every URL at once."""
    started, used = time.perf_counter(), cpu()
    sizes = await asyncio.gather(*(client.get(u) for u in urls))
    assert all(size == len(BODY) for size in sizes)
    return cpu() - used, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--peers", type=int, default=1023)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    # The helper mode (BenchRun.helper adds a port, unused: the helper picks its own ports).
    parser.add_argument("--serve", nargs=3, metavar=("PORTS_FILE", "PEERS", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    results: dict[str, dict[str, list[float]]] = {
        lib: {"cpu": [], "wall": [], "fan_cpu": [], "fan_wall": []} for lib in ("httpx", "aiohttp")
    }
    with BenchRun("hpsim-client-bench-") as run:
        ports_file = run.workdir / "ports"
        run.helper("peers", __file__, "--serve", str(ports_file), str(args.peers))
        deadline = time.monotonic() + 120
        while not ports_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the helper's servers did not come up")
            time.sleep(0.1)
        ports = ports_file.read_text().split()
        urls = [f"http://127.0.0.1:{port}{PATH}" for port in ports]

        async def cell(make: Callable[[], Httpx | Aiohttp], body: Callable[..., Awaitable[object]]) -> None:
            client = make()
            try:
                await body(client)
            finally:
                await client.close()

        for attempt in range(args.runs):
            for make in (Httpx, Aiohttp):

                async def measure(client: Httpx | Aiohttp, attempt: int = attempt) -> None:
                    per_cpu, per_wall = await sequential(client, urls[0], args.calls)
                    fan_cpu, fan_wall = await fan_out(client, urls)
                    found = results[client.name]
                    found["cpu"].append(per_cpu)
                    found["wall"].append(per_wall)
                    found["fan_cpu"].append(fan_cpu)
                    found["fan_wall"].append(fan_wall)
                    progress(
                        f"run {attempt + 1} {client.name}: {per_cpu * 1e6:.0f} us CPU a call, "
                        f"fan-out to {len(urls)}: {fan_wall:.2f} s, {fan_cpu:.2f} s CPU"
                    )

                asyncio.run(cell(make, measure))
    med = {lib: {k: statistics.median(v) for k, v in cells.items()} for lib, cells in results.items()}
    header = f"{'client':>8} {'CPU us/call':>12} {'wall us/call':>13} {'fan-out s':>10} {'fan-out CPU s':>14}"
    lines = [
        f"{lib:>8} {m['cpu'] * 1e6:>12.0f} {m['wall'] * 1e6:>13.0f} {m['fan_wall']:>10.2f} "
        f"{m['fan_cpu']:>14.2f}"
        for lib, m in med.items()
    ]

    def ratio(cell: str) -> float | None:  # None: httpx's CPU too small for os.times to tell
        return med["aiohttp"][cell] / med["httpx"][cell] if med["httpx"][cell] else None

    found = [
        Cell("client CPU per call, aiohttp / httpx", ratio("cpu"), Target("<=", 0.25)),
        Cell(
            f"fan-out to {len(urls)} agents, client CPU, aiohttp / httpx",
            ratio("fan_cpu"),
            Target("<=", 0.25),
        ),
    ]
    notes = [f"medians of {args.runs} runs; sequential: {args.calls} GETs on one kept connection"]
    report = with_notes(table(header, lines), [*notes, *(f"{c.name}: {c.judged()}" for c in found)])
    return finish(report, found, args.json, {"results": results})


if __name__ == "__main__":
    raise SystemExit(main())
