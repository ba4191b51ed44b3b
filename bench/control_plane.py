"""Control-plane throughput benchmark: hyperpod-sim against moto's SageMaker, over AWS JSON 1.1.

Usage::

    python bench/control_plane.py [--duration 5] [--clients 1,8]
        [--operations DescribeCluster,CreateCluster] [--json out.json]

Both servers run as subprocesses on free loopback ports:

* hyperpod-sim: ``hyperpod-sim serve`` with a fresh temporary data dir (SQLite),
  ``HPSIM_PROVISIONING__NODE_READY_DELAY_S=0`` and the account cluster limit raised (the
  CreateCluster cells create thousands of clusters; the default limit is 100).
* moto: ``ThreadedMotoServer`` in its own ``python -c`` process, with werkzeug's per-request
  access log silenced (hyperpod-sim runs without an access log too).

Setup and correctness use boto3: it creates the DescribeCluster target on each server and checks
``describe_cluster`` returns it. A ``before-send`` hook records the exact request botocore puts on
the wire (headers, including a real SigV4 ``Authorization`` and ``X-Amz-Date``, and the JSON body)
for each operation.

Measurement does not use boto3: its signing and parsing cost (~0.85 ms CPU per call) on the same
cores as the servers would make the load generator, not the servers, the bottleneck. Instead each
client is a separate process (multiprocessing, one per client) with one keep-alive
``http.client.HTTPConnection`` that replays the recorded request: ``POST /`` with the same headers
(the static, recorded signature; neither server checks signatures) and body. CreateCluster bodies
are rebuilt per request (``json.dumps`` of the recorded body with a unique ClusterName, the same
serialisation botocore uses). Each client reads the full response and counts non-200 answers as
errors. All clients do a short warm-up, then start together at a barrier and run for a fixed
duration (a client the machine held back past the deadline still measures one request, so a
short cell on a loaded machine never ends with none); latency is ``time.perf_counter()`` around
each request (the body is built before the clock starts); p50/p99 are nearest-rank on the sorted
latencies. Server CPU is read from ``/proc/<pid>/stat`` around each cell.

The request is the same for both servers; moto needs ``ThreadsPerCore`` and a ``SourceS3Uri``
starting with ``s3://sagemaker-``, both of which are valid for the real API.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import sys
import threading
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import (
    HOST,
    HPSIM,
    REGION,
    RawClient,
    Server,
    WireRecorder,
    WireRequest,
    cpu_seconds,
    fmt,
    free_port,
    int_list_option,
    progress,
    sagemaker_client,
    spawn,
    table,
    with_notes,
)
from bench.runner import BenchRun, Cell, Target, finish, wait_in_service

DESCRIBE = "DescribeCluster"
CREATE = "CreateCluster"
OPERATIONS = (DESCRIBE, CREATE)  # Create last: its background work must not skew Describe.
MOTO = "moto"
TARGET_CELL = (DESCRIBE, 8)
TARGET = Target(">=", 2.0, ".1f")
DESCRIBE_CLUSTER = "bench-describe"

INSTANCE_GROUPS: list[dict[str, Any]] = [
    {
        "InstanceGroupName": "workers",
        "InstanceType": "ml.p5.48xlarge",
        "InstanceCount": 2,
        "ExecutionRole": "arn:aws:iam::123456789012:role/hp",
        "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-bench/lc/", "OnCreate": "on_create.sh"},
        "ThreadsPerCore": 1,
    }
]

MOTO_MAIN = """
import logging, sys, threading
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]))
server.start()
print("moto ready", flush=True)
threading.Event().wait()
"""


# ---------------------------------------------------------------------- servers

HPSIM_SETTINGS = {
    "HPSIM_PROVISIONING__MODE": "simulated",
    "HPSIM_PROVISIONING__NODE_READY_DELAY_S": "0",
    "HPSIM_LIMITS__MAX_CLUSTERS": "10000000",
}


def start_moto(workdir: Path) -> Server:
    port = free_port()
    env = dict(os.environ)
    env.setdefault("AWS_DEFAULT_REGION", REGION)
    cmd = [sys.executable, "-c", MOTO_MAIN, HOST, str(port)]
    return spawn(MOTO, cmd, env, workdir / "moto.log", port)


def wait_idle(pid: int, threshold: float = 0.10, window_s: float = 0.25, max_wait_s: float = 5.0) -> None:
    """Wait (bounded) until the server process is below ``threshold`` of one core."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(window_s)
        after = cpu_seconds(pid)
        if before is None or after is None or (after - before) / window_s < threshold:
            return


# ---------------------------------------------------------------------- boto3: setup, check, capture


def make_client(endpoint: str) -> Any:
    """boto3, for setup and the checks only."""
    return sagemaker_client(endpoint, connect_timeout=5, read_timeout=30, max_pool_connections=2)


def create_cluster(client: Any, name: str) -> None:
    client.create_cluster(ClusterName=name, InstanceGroups=json.loads(json.dumps(INSTANCE_GROUPS)))


def sanity_check(server: Server, client: Any, captured: dict[str, WireRequest]) -> None:
    """Create the DescribeCluster target with boto3, check boto3 describes it, then check the raw
    replay of both recorded requests is answered the same way."""
    create_cluster(client, DESCRIBE_CLUSTER)
    desc = client.describe_cluster(ClusterName=DESCRIBE_CLUSTER)  # recorded: the DescribeCluster cells'
    if desc.get("ClusterName") != DESCRIBE_CLUSTER:
        raise RuntimeError(f"{server.name}: DescribeCluster returned {desc.get('ClusterName')!r}")
    wait_in_service(server, DESCRIBE_CLUSTER, 30)
    missing = [op for op in OPERATIONS if op not in captured]
    if missing:
        raise RuntimeError(f"{server.name}: no request captured from botocore for {missing}")

    raw = RawClient(server.port, captured[DESCRIBE])
    try:
        status, data = raw.send(raw.body())
        if status != 200 or json.loads(data).get("ClusterName") != DESCRIBE_CLUSTER:
            raise RuntimeError(f"{server.name}: raw DescribeCluster: HTTP {status}: {data[:300]!r}")
    finally:
        raw.close()
    raw = RawClient(server.port, captured[CREATE])
    check_name = "bench-raw-create-check"
    try:
        status, data = raw.send(raw.body(check_name))
        if status != 200 or "ClusterArn" not in json.loads(data):
            raise RuntimeError(f"{server.name}: raw CreateCluster: HTTP {status}: {data[:300]!r}")
    finally:
        raw.close()
    if client.describe_cluster(ClusterName=check_name).get("ClusterName") != check_name:
        raise RuntimeError(f"{server.name}: cluster created over raw HTTP not visible through boto3")


# ---------------------------------------------------------------------- measurement


@dataclass
class Row:
    operation: str
    clients: int
    server: str
    requests: int
    errors: int
    elapsed_s: float
    req_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_pct: float | None
    server_cpu_ms_per_req: float | None
    loadgen_cpu_pct: float
    first_error: str | None = None


@dataclass(frozen=True)
class ClientJob:
    """What one load-generator process needs (picklable, so 'spawn' works too)."""

    index: int
    port: int
    wire: WireRequest
    name_prefix: str
    warmup: int


BARRIER_TIMEOUT_S = 120.0


def percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _client_process(
    job: ClientJob,
    warmed: multiprocessing.synchronize.Barrier,
    go: multiprocessing.synchronize.Barrier,
    deadline: Any,
    results: multiprocessing.queues.Queue[dict[str, Any]],
) -> None:
    """One load-generator client: warm up, wait at the barrier, then replay until the deadline.

    Puts one dict on ``results``: latencies (array('d') bytes), errors, first_error, finished_at
    (perf_counter; system-wide monotonic clock, comparable across processes) and cpu_s.
    """
    raw = RawClient(job.port, job.wire)  # no I/O yet: the connection opens on the first request
    try:
        counter = itertools.count()
        if job.wire.operation == CREATE:

            def body() -> bytes:
                return raw.body(f"{job.name_prefix}-{next(counter)}")
        else:
            fixed = raw.body()

            def body() -> bytes:
                return fixed

        for _ in range(job.warmup):
            try:
                raw.send(body())
            except (OSError, http.client.HTTPException):
                raw.close()
        warmed.wait(timeout=BARRIER_TIMEOUT_S)
        go.wait(timeout=BARRIER_TIMEOUT_S)
        end: float = deadline.value
        perf = time.perf_counter
        send = raw.send
        latencies = array("d")
        errors = 0
        first_error: str | None = None
        cpu_start = time.process_time()
        while True:
            payload = body()
            start = perf()
            if start >= end and (latencies or errors):
                break  # (a client held back past the deadline still measures one request)
            try:
                status, data = send(payload)
            except (OSError, http.client.HTTPException) as exc:
                raw.close()  # the next request reconnects
                errors += 1
                if first_error is None:
                    first_error = repr(exc)[:300]
                continue
            if status != 200:
                errors += 1
                if first_error is None:
                    first_error = f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}"
                continue
            latencies.append(perf() - start)
        finished_at = perf()
        results.put(
            {
                "index": job.index,
                "latencies": latencies.tobytes(),
                "errors": errors,
                "first_error": first_error,
                "finished_at": finished_at,
                "cpu_s": time.process_time() - cpu_start,
            }
        )
    except BaseException as exc:  # report, and release the parent rather than leave it at a barrier
        warmed.abort()
        go.abort()
        results.put({"index": job.index, "fatal": repr(exc)[:500]})
    finally:
        raw.close()


def _start_method() -> str:
    # fork is cheap (boto3 is already imported) and safe here: the parent runs no threads.
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def row_of(
    server: str,
    operation: str,
    concurrency: int,
    reports: list[dict[str, Any]],
    started: float,
    cpu_before: float | None,
    cpu_after: float | None,
) -> Row:
    """One cell's row from its clients' reports and the server's CPU time around it."""
    ended = max(float(r["finished_at"]) for r in reports)
    elapsed = ended - started
    latencies_arr = array("d")
    for r in reports:
        latencies_arr.frombytes(r["latencies"])
    latencies = sorted(latencies_arr)
    errors = sum(int(r["errors"]) for r in reports)
    loadgen_cpu = sum(float(r["cpu_s"]) for r in reports)
    ok = len(latencies)
    server_cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Row(
        operation=operation,
        clients=concurrency,
        server=server,
        requests=ok,
        errors=errors,
        elapsed_s=round(elapsed, 3),
        req_per_s=round(ok / elapsed, 1) if elapsed > 0 else 0.0,
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        server_cpu_pct=None if server_cpu is None else round(100 * server_cpu / elapsed, 1),
        server_cpu_ms_per_req=None if server_cpu is None or ok == 0 else round(1000 * server_cpu / ok, 3),
        loadgen_cpu_pct=round(100 * loadgen_cpu / elapsed, 1),
        first_error=next((r["first_error"] for r in reports if r["first_error"]), None),
    )


def run_cell(
    server: Server,
    wire: WireRequest,
    operation: str,
    concurrency: int,
    duration_s: float,
    warmup: int,
) -> Row:
    server.check_alive()
    wait_idle(server.proc.pid)
    ctx = (
        multiprocessing.get_context("fork")
        if _start_method() == "fork"
        else multiprocessing.get_context("spawn")
    )
    warmed = ctx.Barrier(concurrency + 1)
    go = ctx.Barrier(concurrency + 1)
    deadline = ctx.Value("d", 0.0, lock=False)
    results: multiprocessing.queues.Queue[dict[str, Any]] = ctx.Queue()
    warmup_each = math.ceil(warmup / concurrency)
    jobs = [
        ClientJob(
            index=i, port=server.port, wire=wire, name_prefix=f"b{concurrency}-p{i}", warmup=warmup_each
        )
        for i in range(concurrency)
    ]
    procs = [
        ctx.Process(target=_client_process, args=(job, warmed, go, deadline, results), daemon=True)
        for job in jobs
    ]
    label = f"{server.name} {operation}@{concurrency}"
    reports: list[dict[str, Any]] = []
    try:
        for proc in procs:
            proc.start()
        try:
            warmed.wait(timeout=BARRIER_TIMEOUT_S)
            cpu_before = cpu_seconds(server.proc.pid)
            started = time.perf_counter()
            deadline.value = started + duration_s  # set before the "go" barrier opens
            go.wait(timeout=BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            fatal = _drain(results, concurrency, timeout_s=5)
            raise RuntimeError(f"{label}: a load-generator process failed: {fatal}") from None
        collect_by = time.monotonic() + duration_s + 60
        while len(reports) < concurrency:
            try:
                report = results.get(timeout=max(0.1, collect_by - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{label}: a load-generator process did not finish") from None
            if "fatal" in report:
                raise RuntimeError(f"{label}: load-generator process {report['index']}: {report['fatal']}")
            reports.append(report)
        cpu_after = cpu_seconds(server.proc.pid)
        for proc in procs:
            proc.join(timeout=10)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        results.close()

    return row_of(server.name, operation, concurrency, reports, started, cpu_before, cpu_after)


def _drain(results: multiprocessing.queues.Queue[dict[str, Any]], limit: int, timeout_s: float) -> str:
    """The first fatal error reported by a load-generator process (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    for _ in range(limit):
        try:
            report = results.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            break
        if "fatal" in report:
            return f"process {report['index']}: {report['fatal']}"
    return "no error reported (timed out at a barrier)"


# ---------------------------------------------------------------------- report


def render(rows: list[Row], ratios: dict[str, float | None], notes: list[str]) -> str:
    header = (
        f"{'operation':<16} {'clients':<8} {'server':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'errors':>7} {'srv CPU%':>9} {'srv ms/req':>10} {'gen CPU%':>9}"
    )
    lines = table(header)
    for r in rows:
        lines.append(
            f"{r.operation:<16} {r.clients:<8} {r.server:<13} {r.req_per_s:>9.1f} {fmt(r.p50_ms, '.2f'):>8} "
            f"{fmt(r.p99_ms, '.2f'):>8} {r.errors:>7} {fmt(r.server_cpu_pct, '.1f'):>9} "
            f"{fmt(r.server_cpu_ms_per_req, '.3f'):>10} {r.loadgen_cpu_pct:>9.1f}"
        )
    lines.append("")
    for key, ratio in ratios.items():
        operation, clients = key.split("@")
        target = f" (target {TARGET})" if (operation, int(clients)) == TARGET_CELL else ""
        lines.append(f"ratio {HPSIM}/{MOTO} {operation} @{clients} clients: {fmt(ratio, '.2f')}x{target}")
    errors = [r for r in rows if r.errors]
    if errors:
        lines.append("")
        for r in errors:
            lines.append(f"errors: {r.server} {r.operation}@{r.clients}: {r.errors} (first: {r.first_error})")
    return with_notes(lines, notes)


def notes_of(args: argparse.Namespace, rows: list[Row]) -> list[str]:
    """The notes printed under the table (and kept in the JSON)."""
    gen_ms = [10 * r.loadgen_cpu_pct / r.req_per_s for r in rows if r.req_per_s > 0]
    gen_range = f"{min(gen_ms):.3f}-{max(gen_ms):.3f} ms" if gen_ms else "-"
    return [
        f"{args.duration:g}s per cell after {args.warmup} warm-up requests (split across clients); "
        f"load generator: one {_start_method()}ed process per client, each with one "
        "keep-alive http.client connection replaying the bytes boto3 sends (POST /, same headers, "
        "recorded static SigV4 Authorization/X-Amz-Date, same JSON body; CreateCluster body "
        "re-serialised per request with a unique ClusterName); boto3 only for setup and the "
        "correctness check (describe_cluster returns the cluster on both servers).",
        "a request counts as ok only with HTTP 200 and the full response body read; latency is "
        "per request inside each client process (perf_counter), req/s is ok requests over the cell.",
        f"the load generator and both servers still share this machine's {os.cpu_count()} CPU(s): "
        "gen CPU% (sum over client processes, 100 = one core) is taken from the server's share; "
        f"raw HTTP cost {gen_range} of client CPU per request in this run (boto3: ~0.85 ms), so the "
        "ratio reflects the servers, but absolute req/s remain below what either server could do "
        "on cores of its own.",
        "srv CPU% is the server process's user+system time over the cell (100 = one core); "
        "srv ms/req is server CPU per successful request.",
        f"{HPSIM}: SQLite in a fresh temp dir, node ready delay 0, cluster limit raised; "
        f"{MOTO}: ThreadedMotoServer (werkzeug, in-memory) in its own process, access log off.",
        "CreateCluster on hyperpod-sim also triggers background reconciler work (node provisioning) "
        "inside the measured server process.",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (default 5)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up requests per cell (default 50)")
    parser.add_argument(
        "--clients",
        default="1,8",
        help="comma-separated concurrency levels, one process per client (default 1,8)",
    )
    parser.add_argument(
        "--operations",
        default=",".join(OPERATIONS),
        help=f"comma-separated operations to measure (default {','.join(OPERATIONS)})",
    )
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds to wait for each server")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    levels = int_list_option(parser, "--clients", args.clients)
    if not levels or min(levels) < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("--clients must list positive integers, --duration be positive, --warmup >= 0")
    wanted = {o.strip() for o in args.operations.split(",") if o.strip()}
    unknown = wanted - set(OPERATIONS)
    if not wanted or unknown:
        parser.error(f"--operations must be a subset of {','.join(OPERATIONS)}; unknown: {sorted(unknown)}")
    args.operations = [o for o in OPERATIONS if o in wanted]  # Create last, whatever the order given.
    args.clients = levels
    return args


def measure_cells(servers: list[Server], args: argparse.Namespace) -> list[Row]:
    """Every operation, level and server: the boto3 setup and check, then one cell each."""
    wires: dict[str, dict[str, WireRequest]] = {}
    for server in servers:
        client = make_client(server.endpoint)
        wires[server.name] = WireRecorder(client).captured  # until client.close()
        sanity_check(server, client, wires[server.name])
        client.close()

    rows: list[Row] = []
    error_shown = False
    for operation in args.operations:
        for level in args.clients:
            for server in servers:
                wire = wires[server.name][operation]
                row = run_cell(server, wire, operation, level, args.duration, args.warmup)
                rows.append(row)
                progress(f"  measured {operation}@{level} {server.name}: {row.req_per_s:.1f} req/s")
                if row.first_error and not error_shown:
                    error_shown = True
                    progress(f"  first error ({server.name} {operation}@{level}): {row.first_error}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with BenchRun("hpsim-bench-") as run:
        hpsim = run.serve(HPSIM_SETTINGS)
        moto = run.add(start_moto(run.workdir))
        run.ready(args.startup_timeout, hpsim)
        run.ready(args.startup_timeout, moto, path="/moto-api/")
        rows = measure_cells(run.servers, args)

        by_cell = {(r.operation, r.clients, r.server): r for r in rows}
        ratios: dict[str, float | None] = {}
        for operation in args.operations:
            for level in args.clients:
                ours, theirs = by_cell[(operation, level, HPSIM)], by_cell[(operation, level, MOTO)]
                ratios[f"{operation}@{level}"] = (
                    round(ours.req_per_s / theirs.req_per_s, 3) if theirs.req_per_s > 0 else None
                )
        target_key = f"{TARGET_CELL[0]}@{TARGET_CELL[1]}"
        what = f"{TARGET_CELL[0]} req/s, {TARGET_CELL[1]} clients, {HPSIM} / {MOTO}"
        cell = Cell(what, ratios.get(target_key), TARGET)
        notes = notes_of(args, rows)
        payload = {
            "rows": [asdict(r) for r in rows],
            "ratios": ratios,
            "target": {"cell": target_key, "min_ratio": TARGET.bound},
            "target_met": cell.met,
            "config": {
                "duration_s": args.duration,
                "warmup": args.warmup,
                "clients": args.clients,
                "operations": args.operations,
                "load_generator": "raw http.client keep-alive, one process per client",
                "cpu_count": os.cpu_count(),
            },
            "notes": notes,
        }
        # No cell when --operations or --clients left the target's cell out.
        cells = [cell] if target_key in ratios else []
        return finish(render(rows, ratios, notes), cells, args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
