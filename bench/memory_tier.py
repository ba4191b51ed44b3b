"""In-memory checkpoint tier benchmark: the library's save and load against our agent and a reference.

Usage::

    python bench/memory_tier.py [--sizes 64,512] [--repeats 3] [--json out.json]

What is measured is what a trainer pays: the public ``amzn-sagemaker-checkpointing`` library's own
``InMemoryCheckpointClient`` (``requests``, unmodified), ``put_checkpoint`` (save: it hashes the
bytes with xxh3-128 and POSTs them) and ``get_checkpoint`` (load: it reads the body and checks the
checksum), of one rank's bytes (random, generated once; smaller sizes are a prefix), with a new step
per save (1, 2, ...). The servers below are measured in the same run, interleaved (each goes first
in turn); medians over ``--repeats``. After each save to ours and to the reference an untimed
metadata rank is saved too, so that ``get_latest_checkpoints`` (checked after each size) lists the
step on both, and each load's bytes are compared with what was saved.

Servers, each a subprocess on a free loopback port:

* **ours**: ``hyperpod-sim serve`` (SQLite in a temp dir, ``local`` provisioner: every node is a real
  ``hyperpod-sim agent`` process) with ``HPSIM_SIMULATION__MEMORY_SCALE=1`` and a cluster of two
  ``ml.p5.48xlarge`` (2 TiB each) with tiered storage at 20 %: each agent's budget is ~410 GiB, far
  above what is stored, so nothing is ever evicted for room. Shards live in shared memory under a
  temp dir in /dev/shm (removed at the end). The library talks to the first node's agent; its
  replica peer is the other node. Default replication is ``async`` (the save is answered once the
  local copy is stored); after each of our saves the script polls that agent's
  ``hpsim_tier_replication_pending`` until 0 before the next timed operation (so background
  replication never overlaps a measurement) and records how long after the ack that was.
* **reference**: a minimal dict-backed FastAPI app under uvicorn (``--reference-server PORT``
  mode of this script), the afternoon version of the same protocol: bytes in the Python heap, no
  checksum verification, retention by dropping a rank's oldest steps.
* **raw HTTP** (the bound): the same library against a server that does next to nothing
  (``--raw-server PORT`` mode: blocking sockets, a large body ``recv_into`` one preallocated buffer,
  answered with ``sendall`` from it, no checks). ``reference / raw HTTP`` is the most any server
  could gain over the reference with this client on this machine.
* **ceiling**: this process ``sendall``\\ s the same bytes over loopback TCP to another process
  (``--ceiling-receiver PORT`` mode) that ``recv_into``\\ s a preallocated, pre-touched buffer and
  answers one byte; MiB/s of size over the round.

Replication, both choices: a second ``hyperpod-sim serve`` with ``HPSIM_AGENT_REPLICATION=sync`` in
its environment (the control plane passes it to the agents it starts) and a second cluster; saves
of each size against the async cluster and the sync cluster, interleaved, each step deleted after
it was measured (untimed). For async: time from the ack until the saving agent reports no
replication pending (the window in which a crash of that node loses the step), polled every
``POLL_S``. For both: whether the peer's ``hpsim_tier_bytes_held`` already held the shard at the ack.

Memory: ``VmRSS`` (and ``RssAnon``/``RssShmem``, ``VmHWM``: the peak since the size started) of
the agent that received the saves, from ``/proc``, before any save (the baseline: the fixed
overhead) and after each size's saves, against its ``hpsim_tier_bytes_held``; the shared-memory
directories' sizes (du): tmpfs pages the agent has not mapped are not in its RSS. The reference
server's RSS is shown next to it. CPU of the servers and of this process (the library client) per
operation comes from ``/proc`` and ``time.process_time``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

# At module level: FastAPI resolves the handlers' (string, see __future__) annotations here.
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import (
    HOST,
    MIB,
    Server,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    free_port,
    http_json,
    int_list_option,
    kill_leftover_agents,
    memory_status,
    poll,
    progress,
    ratio_vs_target,
    recv_exactly,
    sagemaker_client,
    spawn,
    start_hpsim,
    stop_servers,
    table,
    wait_ready,
    with_notes,
    write_json,
)

INSTANCE_TYPE = "ml.p5.48xlarge"
PERCENTAGE = 20
NODES = 2
OURS = "hyperpod-sim"
REFERENCE = "reference"
RAW = "raw HTTP"
TARGET_SAVE = 1.5
TARGET_LOAD = 2.0
TARGET_RSS_FACTOR = 1.2
POLL_S = 0.005
STEPS_RETAINED = 3
ORCHESTRATOR = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/bench"}}
EXECUTION_ROLE = "arn:aws:iam::123456789012:role/hp"
ACK = b"\x01"
LENGTH = struct.Struct("!Q")

T = TypeVar("T")


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


# ---------------------------------------------------------------------- processes


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, same user); whether it worked."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def du_bytes(path: Path) -> int:
    """Disk usage like ``du -s``: allocated blocks of every file under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def start_ours(workdir: Path, shm_root: Path, replication: str) -> Server:
    """``hyperpod-sim serve`` whose agents keep shards under ``shm_root`` and replicate ``replication``
    (async or sync)."""
    settings = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_SIMULATION__MEMORY_SCALE": "1",
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root),
        # Two cores saturated by 512 MiB transfers must not make a node look failed.
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
        "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
        "HPSIM_AGENT_REPLICATION": replication,
    }
    return start_hpsim(workdir, settings, name=f"{OURS} ({replication})")


def start_helper(name: str, workdir: Path, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), *args, str(port)]
    return spawn(name, cmd, dict(os.environ), workdir / f"{name}.log", port)


# ---------------------------------------------------------------------- cluster and agents


@dataclass
class Agent:
    node_id: str
    endpoint: str
    pid: int
    peer_id: str
    peer_endpoint: str
    peer_pid: int


class Metrics:
    """An agent's ``/metrics`` over one keep-alive connection (cheap enough to poll every few ms)."""

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        self.host, self.port = parts.hostname or HOST, parts.port or 80
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)

    def read(self) -> dict[str, float]:
        for attempt in (1, 2):
            try:
                self.conn.request("GET", "/metrics")
                resp = self.conn.getresponse()
                text = resp.read().decode()
                break
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                if attempt == 2:
                    raise
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition(" ")
                values[name] = float(value)
        return values

    def value(self, name: str) -> float:
        return self.read()[name]

    def close(self) -> None:
        self.conn.close()


def create_cluster(server: Server, name: str, deadline_s: float) -> Agent:
    """A 2-node tiered-storage cluster, InService; its first node's agent and that agent's peer."""
    from infra.processes import find_agent_pids

    client = sagemaker_client(server.endpoint, read_timeout=60)
    client.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": INSTANCE_TYPE,
                "InstanceCount": NODES,
                "ExecutionRole": EXECUTION_ROLE,
                "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-bench/lc/", "OnCreate": "on_create.sh"},
            }
        ],
        Orchestrator=ORCHESTRATOR,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": PERCENTAGE},
    )
    status = ""

    def stuck() -> RuntimeError:
        return RuntimeError(f"{name} is {status} (waited for InService):\n{server.log_tail()}")

    def in_service() -> bool | None:
        nonlocal status
        status = client.describe_cluster(ClusterName=name)["ClusterStatus"]
        if status == "InService":
            return True
        if status not in ("Creating", "Updating"):
            raise stuck()
        server.check_alive()
        return None

    poll(in_service, deadline_s, 0.2, stuck)
    listing = http_json(f"{server.endpoint}/clusters/{name}/nodes")["ClusterNodeSummaries"]
    endpoints = {
        n["InstanceId"]: n["AgentStatus"]["Endpoint"]
        for n in listing
        if (n.get("AgentStatus") or {}).get("Endpoint")
    }
    if len(endpoints) != NODES:
        raise RuntimeError(f"{name}: {len(endpoints)} agent endpoints listed, expected {NODES}")
    node_id = next(iter(endpoints))
    policy = http_json(f"{endpoints[node_id]}/v1/policy")
    peers = [p["node_id"] for p in (policy.get("replication") or {}).get("peers", [])]
    if len(peers) != 1 or peers[0] not in endpoints:
        raise RuntimeError(f"{name}: {node_id} has replica peers {peers}, expected the other node")
    pids = {n: find_agent_pids(n) for n in endpoints}
    if any(len(p) != 1 for p in pids.values()):
        raise RuntimeError(f"{name}: agent processes per node: {pids}")
    client.close()
    return Agent(
        node_id=node_id,
        endpoint=endpoints[node_id],
        pid=pids[node_id][0],
        peer_id=peers[0],
        peer_endpoint=endpoints[peers[0]],
        peer_pid=pids[peers[0]][0],
    )


# ---------------------------------------------------------------------- the library's client


def library_client(base_url: str, namespace: str) -> Any:
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.storage.clients.inmemory.inmemory_client import (
        InMemoryCheckpointClient,
    )

    client = InMemoryCheckpointClient(
        namespace=namespace,
        rank="0",
        world_size="1",
        config=InMemoryClientConfig(base_url=base_url, request_timeout=300),
        metadata_file_count=1,
        steps_retained=STEPS_RETAINED,
    )
    client.get_or_create_namespace()
    return client


@dataclass
class Sample:
    seconds: float
    server_cpu_s: float | None
    client_cpu_s: float
    ended: float  # perf_counter() when the call returned


def timed(fn: Callable[[], T], server_pids: list[int]) -> tuple[T, Sample]:
    """Run ``fn``; its result and wall time, the servers' CPU time and this process's CPU time."""
    cpu_before = [cpu_seconds(p) for p in server_pids]
    own_before = time.process_time()
    start = time.perf_counter()
    result = fn()
    ended = time.perf_counter()
    own = time.process_time() - own_before
    cpu_after = [cpu_seconds(p) for p in server_pids]
    server_cpu: float | None = 0.0
    for before, after in zip(cpu_before, cpu_after, strict=True):
        if before is None or after is None or server_cpu is None:
            server_cpu = None
        else:
            server_cpu += after - before
    return result, Sample(seconds=ended - start, server_cpu_s=server_cpu, client_cpu_s=own, ended=ended)


def wait_replicated(metrics: Metrics, since: float, deadline_s: float = 300.0) -> float:
    """Poll ``hpsim_tier_replication_pending`` until 0; seconds from ``since`` (perf_counter) to the
    first answer that said 0."""
    pending = 0.0

    def lag() -> float | None:
        nonlocal pending
        pending = metrics.value("hpsim_tier_replication_pending")
        now = time.perf_counter()
        return now - since if pending == 0 else None

    return poll(
        lag,
        deadline_s,
        POLL_S,
        lambda: TimeoutError(f"replication still pending ({pending}) after {deadline_s}s"),
    )


@dataclass
class Side:
    """One server as the library sees it, for one namespace."""

    name: str
    client: Any
    pids: list[int]
    metrics: Metrics | None = None  # ours: the saving agent's /metrics
    peer_metrics: Metrics | None = None
    complete_steps: bool = True  # save the metadata rank too, and check get_latest_checkpoints


@dataclass
class SaveResult:
    sample: Sample
    lag_s: float | None = None  # async: ack -> no replication pending
    peer_held_at_ack: bool | None = None


def save(side: Side, step: int, payload: bytes) -> SaveResult:
    peer_before = side.peer_metrics.value("hpsim_tier_bytes_held") if side.peer_metrics else 0.0
    _, sample = timed(lambda: side.client.put_checkpoint(step=step, data=payload, rank=0), side.pids)
    result = SaveResult(sample=sample)
    if side.peer_metrics is not None and side.metrics is not None:
        held = side.peer_metrics.value("hpsim_tier_bytes_held")
        result.peer_held_at_ack = held - peer_before >= len(payload)
        result.lag_s = wait_replicated(side.metrics, sample.ended)
    return result


def save_metadata(side: Side, step: int) -> None:
    """The metadata rank of the step (untimed), so that the step is complete for ``latest``."""
    side.client.put_checkpoint(step=step, data=f"metadata of step {step}".encode(), metadata_index=0)
    if side.metrics is not None:
        wait_replicated(side.metrics, time.perf_counter())


def load(side: Side, step: int, payload: bytes) -> Sample:
    loaded, sample = timed(lambda: side.client.get_checkpoint(step=step, rank=0), side.pids)
    if loaded is None or len(loaded) != len(payload) or loaded != payload:
        got = "nothing" if loaded is None else f"{len(loaded)} different bytes"
        raise RuntimeError(f"{side.name}: step {step} loaded {got}, expected the {len(payload)} saved")
    return sample


# ---------------------------------------------------------------------- results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Row:
    size_mib: int
    server: str
    save_s: list[float]
    load_s: list[float]
    save_median_s: float
    load_median_s: float
    save_min_s: float
    load_min_s: float
    save_mib_s: float
    load_mib_s: float
    save_server_cpu_s: float | None
    load_server_cpu_s: float | None
    save_client_cpu_s: float
    load_client_cpu_s: float
    replication_lag_s: list[float] = field(default_factory=list)


def make_row(size: int, server: str, saves: list[SaveResult], loads: list[Sample]) -> Row:
    save_s = [s.sample.seconds for s in saves]
    load_s = [s.seconds for s in loads]
    return Row(
        size_mib=size // MIB,
        server=server,
        save_s=[round(s, 4) for s in save_s],
        load_s=[round(s, 4) for s in load_s],
        save_median_s=round(median(save_s), 4),
        load_median_s=round(median(load_s), 4),
        save_min_s=round(min(save_s), 4),
        load_min_s=round(min(load_s), 4),
        save_mib_s=round(size / MIB / median(save_s), 1),
        load_mib_s=round(size / MIB / median(load_s), 1),
        save_server_cpu_s=median_or_none([s.sample.server_cpu_s for s in saves]),
        load_server_cpu_s=median_or_none([s.server_cpu_s for s in loads]),
        save_client_cpu_s=round(median([s.sample.client_cpu_s for s in saves]), 3),
        load_client_cpu_s=round(median([s.client_cpu_s for s in loads]), 3),
        replication_lag_s=[round(s.lag_s, 4) for s in saves if s.lag_s is not None],
    )


@dataclass
class MemoryRow:
    size_mib: int
    steps_held: int
    bytes_held: int
    agent_baseline_rss: int
    agent_rss: int
    agent_rss_anon: int
    agent_rss_shmem: int
    agent_peak_rss: int | None  # VmHWM since this size's first save (None: could not reset it)
    rss_growth_over_held: float | None
    target_met: bool
    shm_du_saving_node: int
    shm_du_peer_node: int
    reference_rss: int
    reference_baseline_rss: int


@dataclass
class ReplicationRow:
    size_mib: int
    mode: str
    save_s: list[float]
    save_median_s: float
    save_mib_s: float
    lag_s: list[float]
    lag_median_s: float | None
    lag_max_s: float | None
    peer_held_at_ack: list[bool | None]


def mib(value: float) -> str:
    return f"{value / MIB:.1f}"


# ---------------------------------------------------------------------- phases


def shm_usage(shm_root: Path, agent: Agent) -> tuple[int, int]:
    """du of the saving node's and its peer's shared-memory directories (LocalProvisioner layout)."""
    return du_bytes(shm_root / agent.node_id), du_bytes(shm_root / agent.peer_id)


def measure_main(
    ours: Agent,
    shm_root: Path,
    reference: Server,
    raw: Server,
    payloads: dict[int, bytes],
    repeats: int,
    progress: Callable[[str], None],
) -> tuple[list[Row], list[MemoryRow]]:
    """Save and load every size through the library against every server, interleaved."""
    rows: list[Row] = []
    memory: list[MemoryRow] = []
    baseline = memory_status(ours.pid)
    reference_baseline = memory_status(reference.proc.pid)
    metrics, peer_metrics = Metrics(ours.endpoint), Metrics(ours.peer_endpoint)
    try:
        for size, payload in payloads.items():
            namespace = f"bench-{size // MIB}"
            ours_client = library_client(ours.endpoint, namespace)
            sides = [
                Side(OURS, ours_client, [ours.pid, ours.peer_pid], metrics, peer_metrics),
                Side(REFERENCE, library_client(reference.endpoint, namespace), [reference.proc.pid]),
                Side(RAW, library_client(raw.endpoint, namespace), [raw.proc.pid], complete_steps=False),
            ]
            peak_reset = reset_peak_rss(ours.pid)
            saves: dict[str, list[SaveResult]] = {s.name: [] for s in sides}
            loads: dict[str, list[Sample]] = {s.name: [] for s in sides}
            for step in range(1, repeats + 1):
                first = (step - 1) % len(sides)
                order = sides[first:] + sides[:first]  # each server goes first in turn
                for side in order:
                    saves[side.name].append(save(side, step, payload))
                    if side.complete_steps:
                        save_metadata(side, step)
                for side in order:
                    loads[side.name].append(load(side, step, payload))
                progress(
                    f"  {size // MIB} MiB step {step}: "
                    + ", ".join(
                        f"{s.name} save {saves[s.name][-1].sample.seconds:.3f} s "
                        f"load {loads[s.name][-1].seconds:.3f} s"
                        for s in sides
                    )
                )
            expected = list(range(repeats, max(0, repeats - STEPS_RETAINED), -1))
            for side in sides:
                got = side.client.get_latest_checkpoints() if side.complete_steps else expected
                if got != expected:
                    raise RuntimeError(f"{side.name}: latest steps {got}, expected {expected}")
                rows.append(make_row(size, side.name, saves[side.name], loads[side.name]))

            status = memory_status(ours.pid)
            held = int(metrics.value("hpsim_tier_bytes_held"))
            du_own, du_peer = shm_usage(shm_root, ours)
            growth = status["VmRSS"] - baseline["VmRSS"]
            memory.append(
                MemoryRow(
                    size_mib=size // MIB,
                    steps_held=min(repeats, STEPS_RETAINED),
                    bytes_held=held,
                    agent_baseline_rss=baseline["VmRSS"],
                    agent_rss=status["VmRSS"],
                    agent_rss_anon=status.get("RssAnon", 0),
                    agent_rss_shmem=status.get("RssShmem", 0),
                    agent_peak_rss=status.get("VmHWM") if peak_reset else None,
                    rss_growth_over_held=round(growth / held, 4) if held else None,
                    target_met=status["VmRSS"] <= TARGET_RSS_FACTOR * held + baseline["VmRSS"],
                    shm_du_saving_node=du_own,
                    shm_du_peer_node=du_peer,
                    reference_rss=memory_status(reference.proc.pid).get("VmRSS", 0),
                    reference_baseline_rss=reference_baseline.get("VmRSS", 0),
                )
            )
            for side in sides:  # untimed: free the memory before the next size
                side.client.delete_namespace()
                side.client.close()
    finally:
        metrics.close()
        peer_metrics.close()
    return rows, memory


def measure_replication(
    agents: dict[str, Agent], payloads: dict[int, bytes], repeats: int, progress: Callable[[str], None]
) -> list[ReplicationRow]:
    """Saves against the async and the sync cluster, interleaved; each step deleted once measured."""
    rows: list[ReplicationRow] = []
    opened: list[Metrics] = []
    try:
        for size, payload in payloads.items():
            namespace = f"replication-{size // MIB}"
            sides: list[Side] = []
            for mode, agent in agents.items():
                metrics, peer_metrics = Metrics(agent.endpoint), Metrics(agent.peer_endpoint)
                opened += [metrics, peer_metrics]
                client = library_client(agent.endpoint, namespace)
                sides.append(Side(mode, client, [agent.pid, agent.peer_pid], metrics, peer_metrics))
            results: dict[str, list[SaveResult]] = {s.name: [] for s in sides}
            for step in range(1, repeats + 1):
                for side in sides if step % 2 else sides[::-1]:
                    results[side.name].append(save(side, step, payload))
                    side.client.delete_checkpoint(step=step, rank=0)  # untimed: bounds memory
                progress(
                    f"  replication {size // MIB} MiB step {step}: "
                    + ", ".join(f"{s.name} save {results[s.name][-1].sample.seconds:.3f} s" for s in sides)
                )
            for side in sides:
                saves = results[side.name]
                seconds = [s.sample.seconds for s in saves]
                lags = [s.lag_s for s in saves if s.lag_s is not None]
                rows.append(
                    ReplicationRow(
                        size_mib=size // MIB,
                        mode=side.name,
                        save_s=[round(s, 4) for s in seconds],
                        save_median_s=round(median(seconds), 4),
                        save_mib_s=round(size / MIB / median(seconds), 1),
                        lag_s=[round(lag, 4) for lag in lags],
                        lag_median_s=round(median(lags), 4) if lags else None,
                        lag_max_s=round(max(lags), 4) if lags else None,
                        peer_held_at_ack=[s.peer_held_at_ack for s in saves],
                    )
                )
                side.client.delete_namespace()
                side.client.close()
    finally:
        for metrics in opened:
            metrics.close()
    return rows


# ---------------------------------------------------------------------- report


@dataclass
class Ratio:
    size_mib: int
    save: float
    load: float
    save_met: bool
    load_met: bool
    # reference / raw HTTP, best of the repeats on both sides: the most any server could gain over
    # the reference with this client here
    save_bound: float | None
    load_bound: float | None
    load_client_share: float  # the library's own CPU time / ours' load time (medians)


def ratios_of(rows: list[Row]) -> list[Ratio]:
    by = {(r.size_mib, r.server): r for r in rows}
    found = []
    for size in sorted({r.size_mib for r in rows}):
        ours, ref, raw = by[(size, OURS)], by[(size, REFERENCE)], by.get((size, RAW))
        save_ratio = ref.save_median_s / ours.save_median_s
        load_ratio = ref.load_median_s / ours.load_median_s
        found.append(
            Ratio(
                size_mib=size,
                save=round(save_ratio, 3),
                load=round(load_ratio, 3),
                save_met=save_ratio >= TARGET_SAVE,
                load_met=load_ratio >= TARGET_LOAD,
                save_bound=None if raw is None else round(ref.save_min_s / raw.save_min_s, 3),
                load_bound=None if raw is None else round(ref.load_min_s / raw.load_min_s, 3),
                load_client_share=round(ours.load_client_cpu_s / ours.load_median_s, 3),
            )
        )
    return found


def render(
    rows: list[Row],
    ratios: list[Ratio],
    ceiling: dict[int, list[float]],
    replication: list[ReplicationRow],
    memory: list[MemoryRow],
    notes: list[str],
) -> str:
    header = (
        f"{'size MiB':>8}  {'server':<13} {'save s':>7} {'load s':>7} {'save MiB/s':>10} {'load MiB/s':>10}"
        f"  {'srv CPU s save/load':>19}  {'lib CPU s save/load':>19}"
    )
    lines = table(header)
    for r in rows:
        srv = f"{fmt(r.save_server_cpu_s, '.2f')}/{fmt(r.load_server_cpu_s, '.2f')}"
        cli = f"{r.save_client_cpu_s:.2f}/{r.load_client_cpu_s:.2f}"
        lines.append(
            f"{r.size_mib:>8}  {r.server:<13} {r.save_median_s:>7.3f} {r.load_median_s:>7.3f} "
            f"{r.save_mib_s:>10.1f} {r.load_mib_s:>10.1f}  {srv:>19}  {cli:>19}"
        )
    lines.append("")
    for q in ratios:
        lines.append(
            f"ratio {OURS}/{REFERENCE} {q.size_mib} MiB: save {q.save:.2f}x (target >= {TARGET_SAVE:g}x) "
            f"{'met' if q.save_met else 'NOT MET'}; load {q.load:.2f}x (target >= {TARGET_LOAD:g}x) "
            f"{'met' if q.load_met else 'NOT MET'}"
        )
        if q.save_bound is not None and q.load_bound is not None:
            lines.append(
                f"  bound {q.size_mib} MiB, {REFERENCE}/{RAW} best of {len(rows[0].save_s)} (the same client "
                f"against a server doing next to nothing): save {q.save_bound:.2f}x, load "
                f"{q.load_bound:.2f}x; the library's own CPU is {100 * q.load_client_share:.0f} % "
                "of our load time"
            )
    for size, rounds in ceiling.items():
        best = max(
            (r.save_mib_s, r.load_mib_s) for r in rows if r.size_mib == size // MIB and r.server == OURS
        )
        rate = size / MIB / median(rounds)
        lines.append(
            f"ceiling {size // MIB} MiB (loopback TCP, sendall -> recv_into, one process to another): "
            f"{rate:.1f} MiB/s; ours reaches {100 * best[0] / rate:.0f} % of it saving, "
            f"{100 * best[1] / rate:.0f} % loading"
        )

    if replication:
        lines.append("")
        header = (
            f"{'size MiB':>8}  {'replication':<11} {'save s':>7} {'save MiB/s':>10} "
            f"{'ack -> replica s (median, max)':>30}  {'replica held at ack':>19}"
        )
        lines += table(header)
        for p in replication:
            lag = "-" if p.lag_median_s is None else f"{p.lag_median_s:.3f}, {p.lag_max_s:.3f}"
            if p.mode == "sync":
                lag = "0 (before the ack)"
            held = sum(1 for h in p.peer_held_at_ack if h)
            lines.append(
                f"{p.size_mib:>8}  {p.mode:<11} {p.save_median_s:>7.3f} {p.save_mib_s:>10.1f} "
                f"{lag:>30}  {f'{held}/{len(p.peer_held_at_ack)}':>19}"
            )
        by = {(p.size_mib, p.mode): p for p in replication}
        for size in sorted({p.size_mib for p in replication}):
            if (size, "async") in by and (size, "sync") in by:
                slower = by[(size, "sync")].save_median_s / by[(size, "async")].save_median_s
                lines.append(f"sync / async save time {size} MiB: {slower:.2f}x")

    if memory:
        lines.append("")
        header = (
            f"{'size MiB':>8} {'held MiB':>9} {'agt RSS MiB':>11} {'- base':>7} {'anon':>7} {'shmem':>7} "
            f"{'peak':>7} {'growth/held':>11} {'shm du own':>10} {'shm du peer':>11} {'ref RSS MiB':>11}"
        )
        lines += table(header)
        for m in memory:
            lines.append(
                f"{m.size_mib:>8} {mib(m.bytes_held):>9} {mib(m.agent_rss):>11} "
                f"{mib(m.agent_rss - m.agent_baseline_rss):>7} {mib(m.agent_rss_anon):>7} "
                f"{mib(m.agent_rss_shmem):>7} "
                f"{'-' if m.agent_peak_rss is None else mib(m.agent_peak_rss):>7} "
                f"{fmt(m.rss_growth_over_held, '.3f'):>11} {mib(m.shm_du_saving_node):>10} "
                f"{mib(m.shm_du_peer_node):>11} {mib(m.reference_rss):>11}"
            )
        base = memory[0].agent_baseline_rss
        met = all(m.target_met for m in memory)
        lines.append(
            f"agent RSS <= {TARGET_RSS_FACTOR:g} x bytes held + fixed overhead (the baseline RSS before "
            f"any save, {mib(base)} MiB): {'met' if met else 'NOT MET'}"
        )
        for m in memory:
            if m.agent_peak_rss is not None:
                extra = (m.agent_peak_rss - m.agent_baseline_rss) / (m.size_mib * MIB)
                lines.append(
                    f"peak RSS while saving and loading {m.size_mib} MiB shards: {mib(m.agent_peak_rss)} MiB "
                    f"= baseline + {extra:.2f} x one shard"
                )
    return with_notes(lines, notes)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,512", help="MiB per rank, comma-separated (default 64,512)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per size (default 3)")
    parser.add_argument("--no-replication", action="store_true", help="skip the async/sync comparison")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for each server")
    parser.add_argument("--create-timeout", type=float, default=120.0, help="seconds for InService")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--reference-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--ceiling-receiver", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--ceiling-bytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--raw-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reference_server is not None:
        return run_reference_server(args.reference_server)
    if args.ceiling_receiver is not None:
        return run_ceiling_receiver(args.ceiling_receiver, args.ceiling_bytes)
    if args.raw_server is not None:
        return run_raw_http_server(args.raw_server, args.raw_bytes)
    sizes = [mib * MIB for mib in int_list_option(parser, "--sizes", args.sizes, " (MiB)")]
    if not sizes or sizes[0] < MIB or args.repeats < 1:
        parser.error("--sizes must list positive integers (MiB) and --repeats be >= 1")

    exit_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="hpsim-tier-bench-"))
    shm_base = Path(tempfile.mkdtemp(prefix="hpsim-tier-bench-", dir="/dev/shm"))
    servers: list[Server] = []
    try:
        ours = start_ours(workdir / "async", shm_base / "async", "async")
        servers.append(ours)
        reference = start_helper(REFERENCE, workdir, "--reference-server")
        servers.append(reference)
        wait_ready(ours, args.startup_timeout)
        wait_ready(reference, args.startup_timeout)
        agent = create_cluster(ours, "bench-tier", args.create_timeout)
        budget = Metrics(agent.endpoint)
        progress(
            f"  cluster InService: saving agent {agent.node_id} at {agent.endpoint} (pid {agent.pid}), "
            f"replica peer {agent.peer_id}; budget {budget.value('hpsim_tier_budget_bytes') / 2**30:.1f} GiB"
        )
        budget.close()

        started = time.perf_counter()
        largest = os.urandom(sizes[-1])
        payloads = {size: largest if size == len(largest) else largest[:size] for size in sizes}
        progress(f"  {len(payloads)} payload(s) generated in {time.perf_counter() - started:.1f} s")

        receiver = start_helper("ceiling", workdir, "--ceiling-bytes", str(sizes[-1]), "--ceiling-receiver")
        servers.append(receiver)
        wait_ready(receiver, args.startup_timeout, path=None)
        ceiling = measure_ceiling(receiver.port, payloads, args.repeats)
        receiver.stop()
        progress(
            "  ceiling: "
            + ", ".join(f"{s // MIB} MiB {s / MIB / median(r):.0f} MiB/s" for s, r in ceiling.items())
        )

        raw = start_helper(RAW.replace(" ", "-"), workdir, "--raw-bytes", str(sizes[-1]), "--raw-server")
        servers.append(raw)
        wait_ready(raw, args.startup_timeout, path=None)
        rows, memory = measure_main(
            agent, shm_base / "async", reference, raw, payloads, args.repeats, progress
        )
        ratios = ratios_of(rows)
        reference.stop()
        raw.stop()

        replication: list[ReplicationRow] = []
        if not args.no_replication:
            sync_server = start_ours(workdir / "sync", shm_base / "sync", "sync")
            servers.append(sync_server)
            wait_ready(sync_server, args.startup_timeout)
            sync_agent = create_cluster(sync_server, "bench-tier-sync", args.create_timeout)
            replication = measure_replication(
                {"async": agent, "sync": sync_agent}, payloads, args.repeats, progress
            )

        notes = [
            "save = the library's put_checkpoint (xxh3-128 of the bytes in the client, then one POST "
            "through requests); load = get_checkpoint (requests reads the body in 10 KiB pieces and "
            "joins them; the client then hashes it and compares the checksum). Both are the library's own "
            "cost, paid the same way against both servers: lib CPU s is this process's CPU time per "
            "operation, srv CPU s the server processes' (ours: the saving agent and its peer).",
            f"one rank, new step per save (1..{args.repeats}), the servers interleaved (each goes first in "
            f"turn), medians over {args.repeats}; MiB/s = size / median time. After "
            "each save of ours the script waits (untimed) for the agent to report no replication "
            "pending, so background replication never overlaps another measurement.",
            f"the servers, the agents, the control plane and the client share this machine's "
            f"{os.cpu_count()} CPU(s): an agent hashing or replicating takes CPU from the client.",
            f"ours verifies every shard's checksum as it stores it and again as it serves it, and keeps "
            f"it in shared memory (tmpfs) that survives an agent crash; the {REFERENCE} keeps bytes in "
            "the Python heap of one uvicorn process (FastAPI, await request.body(), Response(content=...)), "
            "verifies nothing, and loses everything with its process.",
            "replication: async answers once the local copy is stored and replicates right after (ack -> "
            f"replica is until the agent's hpsim_tier_replication_pending was 0, polled every "
            f"{POLL_S * 1000:g} ms: the window a crash of that node could lose the step); sync answers "
            "once the peer stored the replica too (replica held at ack: the peer's hpsim_tier_bytes_held "
            "had grown by the shard when the save returned).",
            f"{RAW}: the same library against a blocking-socket server that recv_into's one buffer and "
            "sendall's it back, checking nothing: what is left is the client's own cost and the loopback "
            "copy; bound = reference / raw HTTP time (best of the repeats for both, as the shared machine's "
            "hiccups hit single loads by up to 2x), the highest ratio any server could reach here.",
            "memory: VmRSS of the saving agent (anon = heap, shmem = mapped shared-memory pages) after "
            "each size's saves, against its hpsim_tier_bytes_held; '- base' is RSS minus the agent's RSS "
            "before any save; peak = VmHWM since that size's first save. Shard pages live in tmpfs and "
            "count in the agent's RSS only while it maps them: 'shm du' is where the bytes are (own = "
            "the saving node's directory, its local copies; peer = the replicas).",
            f"ours: {NODES} x {INSTANCE_TYPE} at {PERCENTAGE} %, memory scale 1 (budget ~410 GiB a node, "
            "nothing evicted for room), SQLite, local provisioner; ceiling: one untimed round first, "
            f"then {args.repeats} timed, median.",
        ]
        print(render(rows, ratios, ceiling, replication, memory, notes))
        if args.json:
            target_ratios: list[dict[str, Any]] = []
            for q in ratios:
                target_ratios += [
                    ratio_vs_target(
                        f"save speed {q.size_mib} MiB (library's put_checkpoint), {OURS} / {REFERENCE}",
                        q.save,
                        f">= {TARGET_SAVE:g}x",
                        q.save_met,
                    ),
                    ratio_vs_target(
                        f"load speed {q.size_mib} MiB (library's get_checkpoint), {OURS} / {REFERENCE}",
                        q.load,
                        f">= {TARGET_LOAD:g}x",
                        q.load_met,
                    ),
                ]
            for m in memory:
                target_ratios.append(
                    ratio_vs_target(
                        f"agent RSS growth / bytes held, {m.size_mib} MiB shards",
                        m.rss_growth_over_held,
                        f"<= {TARGET_RSS_FACTOR:g}x",
                        m.target_met,
                    )
                )
            payload = {
                "rows": [asdict(r) for r in rows],
                "ratios": [asdict(q) for q in ratios],
                "target_ratios": target_ratios,
                "targets": {"save": TARGET_SAVE, "load": TARGET_LOAD, "rss_factor": TARGET_RSS_FACTOR},
                "targets_met": {
                    "save": all(q.save_met for q in ratios),
                    "load": all(q.load_met for q in ratios),
                    "rss": all(m.target_met for m in memory),
                },
                "ceiling_s": {str(s // MIB): r for s, r in ceiling.items()},
                "ceiling_mib_s": {str(s // MIB): round(s / MIB / median(r), 1) for s, r in ceiling.items()},
                "replication": [asdict(p) for p in replication],
                "memory": [asdict(m) for m in memory],
                "config": {
                    "sizes_mib": [s // MIB for s in sizes],
                    "repeats": args.repeats,
                    "instance_type": INSTANCE_TYPE,
                    "nodes": NODES,
                    "percentage": PERCENTAGE,
                    "cpu_count": os.cpu_count(),
                },
                "notes": notes,
            }
            write_json(args.json, payload)
        return 0
    finally:
        stop_servers(servers)
        left = kill_leftover_agents(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_base, ignore_errors=True)
        if left:
            with contextlib.suppress(OSError):  # stderr may be a closed pipe by now
                progress(f"  stopped {left} agent process(es)")


if __name__ == "__main__":
    sys.exit(main())
