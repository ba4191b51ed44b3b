"""Control-plane throughput benchmark: hyperpod-sim against moto's SageMaker, over AWS JSON 1.1.

Usage::

    python bench/control_plane.py [--duration 5] [--clients 1,8] [--json out.json]

Both servers run as subprocesses on free loopback ports:

* hyperpod-sim: ``hyperpod-sim serve`` with a fresh temporary data dir (SQLite),
  ``HPSIM_PROVISIONING__NODE_READY_DELAY_S=0`` and the account cluster limit raised (the
  CreateCluster cells create thousands of clusters; the default limit is 100).
* moto: ``ThreadedMotoServer`` in its own ``python -c`` process, with werkzeug's per-request
  access log silenced (hyperpod-sim runs without an access log too).

For every operation (DescribeCluster on one pre-created cluster, CreateCluster with a unique name
per call), every concurrency level and every server, the load generator runs N threads in this
process, each with its own boto3 client (own session, no retries), for a fixed duration after a
short warm-up. Latency is ``time.perf_counter()`` around each call; p50/p99 are nearest-rank on the
sorted latencies. Server CPU is read from ``/proc/<pid>/stat`` around each cell.

The request is the same for both servers; moto needs ``ThreadsPerCore`` and a ``SourceS3Uri``
starting with ``s3://sagemaker-``, both of which are valid for the real API.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

HOST = "127.0.0.1"
REGION = "us-east-1"
DESCRIBE = "DescribeCluster"
CREATE = "CreateCluster"
OPERATIONS = (DESCRIBE, CREATE)  # Create last: its background work must not skew Describe.
HPSIM = "hyperpod-sim"
MOTO = "moto"
TARGET_CELL = (DESCRIBE, 8)
TARGET_RATIO = 2.0
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

CLIENT_CONFIG = Config(
    retries={"total_max_attempts": 1, "mode": "standard"},
    connect_timeout=5,
    read_timeout=30,
    max_pool_connections=2,
)


# ---------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc (None where there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)


def _spawn(name: str, cmd: list[str], env: dict[str, str], log_path: Path, port: int) -> Server:
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; `finally` stops the servers.
        )
    return Server(name=name, port=port, proc=proc, log_path=log_path)


def _hpsim_command() -> list[str]:
    script = Path(sys.executable).parent / "hyperpod-sim"
    if script.exists():
        return [str(script)]
    found = shutil.which("hyperpod-sim")
    return [found] if found else [sys.executable, "-m", "hyperpod_sim"]


def start_hpsim(workdir: Path) -> Server:
    port = free_port()
    data_dir = workdir / "hpsim-data"
    env = dict(os.environ)
    env.update(
        {
            "HPSIM_PROVISIONING__NODE_READY_DELAY_S": "0",
            "HPSIM_LIMITS__MAX_CLUSTERS": "10000000",
        }
    )
    cmd = [
        *_hpsim_command(),
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--log-level",
        "warning",
    ]
    return _spawn(HPSIM, cmd, env, workdir / "hpsim.log", port)


def start_moto(workdir: Path) -> Server:
    port = free_port()
    env = dict(os.environ)
    env.setdefault("AWS_DEFAULT_REGION", REGION)
    cmd = [sys.executable, "-c", MOTO_MAIN, HOST, str(port)]
    return _spawn(MOTO, cmd, env, workdir / "moto.log", port)


def wait_ready(server: Server, path: str, deadline_s: float) -> None:
    """Poll ``GET path`` until it answers 200, within ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    last_error = "no attempt"
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            with urllib.request.urlopen(f"{server.endpoint}{path}", timeout=2) as resp:
                if resp.status == 200:
                    return
                last_error = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"HTTP {exc.code}"
        except (OSError, urllib.error.URLError) as exc:
            last_error = repr(exc)
        time.sleep(0.1)
    raise TimeoutError(
        f"{server.name} not ready at {server.endpoint}{path} within {deadline_s}s ({last_error}); "
        f"log tail:\n{server.log_tail()}"
    )


def wait_idle(pid: int, threshold: float = 0.10, window_s: float = 0.25, max_wait_s: float = 5.0) -> None:
    """Wait (bounded) until the server process is below ``threshold`` of one core."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(window_s)
        after = cpu_seconds(pid)
        if before is None or after is None or (after - before) / window_s < threshold:
            return


# ---------------------------------------------------------------------- clients and calls


def make_client(endpoint: str) -> Any:
    session = boto3.session.Session()
    return session.client(
        "sagemaker",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="x",
        aws_secret_access_key="y",
        config=CLIENT_CONFIG,
    )


def create_cluster(client: Any, name: str) -> None:
    client.create_cluster(ClusterName=name, InstanceGroups=json.loads(json.dumps(INSTANCE_GROUPS)))


def sanity_check(server: Server, client: Any) -> None:
    """Create the DescribeCluster target and check the server really answers both operations."""
    create_cluster(client, DESCRIBE_CLUSTER)
    deadline = time.monotonic() + 30
    while True:
        desc = client.describe_cluster(ClusterName=DESCRIBE_CLUSTER)
        if desc.get("ClusterName") != DESCRIBE_CLUSTER:
            raise RuntimeError(f"{server.name}: DescribeCluster returned {desc.get('ClusterName')!r}")
        if desc.get("ClusterStatus") == "InService":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{server.name}: {DESCRIBE_CLUSTER} not InService: {desc.get('ClusterStatus')}"
            )
        time.sleep(0.1)


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


@dataclass
class _Worker:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    finished_at: float = 0.0


def percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _call_factory(operation: str, client: Any, prefix: str) -> Callable[[], None]:
    if operation == DESCRIBE:

        def describe() -> None:
            client.describe_cluster(ClusterName=DESCRIBE_CLUSTER)

        return describe
    counter: Iterator[int] = itertools.count()

    def create() -> None:
        create_cluster(client, f"{prefix}-{next(counter)}")

    return create


def run_cell(
    server: Server,
    clients: list[Any],
    operation: str,
    concurrency: int,
    duration_s: float,
    warmup: int,
) -> Row:
    server.check_alive()
    wait_idle(server.proc.pid)
    calls = [_call_factory(operation, clients[i], f"b{concurrency}-t{i}") for i in range(concurrency)]
    workers = [_Worker() for _ in range(concurrency)]
    warmed = threading.Barrier(concurrency + 1)
    go = threading.Barrier(concurrency + 1)
    state: dict[str, float] = {}
    warmup_each = math.ceil(warmup / concurrency)

    def work(index: int) -> None:
        call, rec = calls[index], workers[index]
        for _ in range(warmup_each):
            with contextlib.suppress(Exception):
                call()
        warmed.wait()
        go.wait()
        deadline = state["deadline"]
        perf = time.perf_counter
        while True:
            start = perf()
            if start >= deadline:
                break
            try:
                call()
            except Exception as exc:
                rec.errors += 1
                if rec.first_error is None:
                    rec.first_error = repr(exc)[:300]
                continue
            rec.latencies.append(perf() - start)
        rec.finished_at = perf()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    # Warm-up is bounded by the client timeouts; the deadline is set before the "go" barrier opens.
    warmed.wait(timeout=120)
    cpu_before = cpu_seconds(server.proc.pid)
    proc_before = time.process_time()
    started = time.perf_counter()
    state["deadline"] = started + duration_s
    go.wait(timeout=30)
    for thread in threads:
        thread.join(timeout=duration_s + 60)
        if thread.is_alive():
            raise TimeoutError(f"{server.name} {operation}@{concurrency}: a load thread did not finish")
    ended = max(w.finished_at for w in workers)
    cpu_after = cpu_seconds(server.proc.pid)
    proc_after = time.process_time()
    elapsed = ended - started

    latencies = sorted(itertools.chain.from_iterable(w.latencies for w in workers))
    errors = sum(w.errors for w in workers)
    ok = len(latencies)
    server_cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Row(
        operation=operation,
        clients=concurrency,
        server=server.name,
        requests=ok,
        errors=errors,
        elapsed_s=round(elapsed, 3),
        req_per_s=round(ok / elapsed, 1) if elapsed > 0 else 0.0,
        p50_ms=round(percentile(latencies, 50) * 1000, 2),
        p99_ms=round(percentile(latencies, 99) * 1000, 2),
        server_cpu_pct=None if server_cpu is None else round(100 * server_cpu / elapsed, 1),
        server_cpu_ms_per_req=None if server_cpu is None or ok == 0 else round(1000 * server_cpu / ok, 3),
        loadgen_cpu_pct=round(100 * (proc_after - proc_before) / elapsed, 1),
        first_error=next((w.first_error for w in workers if w.first_error), None),
    )


# ---------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def render(rows: list[Row], ratios: dict[str, float | None], notes: list[str]) -> str:
    header = (
        f"{'operation':<16} {'clients':<8} {'server':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'errors':>7} {'srv CPU%':>9} {'srv ms/req':>10} {'gen CPU%':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.operation:<16} {r.clients:<8} {r.server:<13} {r.req_per_s:>9.1f} {_fmt(r.p50_ms, '.2f'):>8} "
            f"{_fmt(r.p99_ms, '.2f'):>8} {r.errors:>7} {_fmt(r.server_cpu_pct, '.1f'):>9} "
            f"{_fmt(r.server_cpu_ms_per_req, '.3f'):>10} {r.loadgen_cpu_pct:>9.1f}"
        )
    lines.append("")
    for key, ratio in ratios.items():
        operation, clients = key.split("@")
        target = f" (target >= {TARGET_RATIO:.1f}x)" if (operation, int(clients)) == TARGET_CELL else ""
        lines.append(f"ratio {HPSIM}/{MOTO} {operation} @{clients} clients: {_fmt(ratio, '.2f')}x{target}")
    errors = [r for r in rows if r.errors]
    if errors:
        lines.append("")
        for r in errors:
            lines.append(f"errors: {r.server} {r.operation}@{r.clients}: {r.errors} (first: {r.first_error})")
    lines.append("")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per cell (default 5)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up requests per cell (default 50)")
    parser.add_argument("--clients", default="1,8", help="comma-separated concurrency levels (default 1,8)")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds to wait for each server")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    levels = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    if not levels or min(levels) < 1 or args.duration <= 0:
        parser.error("--clients must list positive integers and --duration must be positive")

    workdir = Path(tempfile.mkdtemp(prefix="hpsim-bench-"))
    servers: list[Server] = []
    try:
        hpsim = start_hpsim(workdir)
        servers.append(hpsim)
        moto = start_moto(workdir)
        servers.append(moto)
        wait_ready(hpsim, "/health", args.startup_timeout)
        wait_ready(moto, "/moto-api/", args.startup_timeout)

        clients: dict[str, list[Any]] = {}
        for server in servers:
            clients[server.name] = [make_client(server.endpoint) for _ in range(max(levels))]
            sanity_check(server, clients[server.name][0])

        rows: list[Row] = []
        for operation in OPERATIONS:
            for level in levels:
                for server in servers:
                    row = run_cell(server, clients[server.name], operation, level, args.duration, args.warmup)
                    rows.append(row)
                    print(
                        f"  measured {operation}@{level} {server.name}: {row.req_per_s:.1f} req/s",
                        file=sys.stderr,
                        flush=True,
                    )

        by_cell = {(r.operation, r.clients, r.server): r for r in rows}
        ratios: dict[str, float | None] = {}
        for operation in OPERATIONS:
            for level in levels:
                ours, theirs = by_cell[(operation, level, HPSIM)], by_cell[(operation, level, MOTO)]
                ratios[f"{operation}@{level}"] = (
                    round(ours.req_per_s / theirs.req_per_s, 3) if theirs.req_per_s > 0 else None
                )
        target_ratio = ratios.get(f"{TARGET_CELL[0]}@{TARGET_CELL[1]}")
        target_met = target_ratio is not None and target_ratio >= TARGET_RATIO

        notes = [
            f"{args.duration:g}s per cell after {args.warmup} warm-up requests; load generator: threads in "
            "one process, one boto3 client (own session, retries off) per thread, keep-alive connections.",
            f"client and both servers share this machine's {os.cpu_count()} CPU(s): boto3 signing/parsing "
            "(gen CPU%) competes with the server for cores; that cost is the same for both servers, so "
            "the ratio is fair, but absolute req/s understate what either server could do alone.",
            "srv CPU% is the server process's user+system time over the cell (100 = one core); "
            "srv ms/req is server CPU per successful request.",
            f"{HPSIM}: SQLite in a fresh temp dir, node ready delay 0, cluster limit raised; "
            f"{MOTO}: ThreadedMotoServer (werkzeug, in-memory) in its own process, access log off.",
            "CreateCluster on hyperpod-sim also triggers background reconciler work (node provisioning) "
            "inside the measured server process.",
        ]
        print(render(rows, ratios, notes))
        if args.json:
            payload = {
                "rows": [asdict(r) for r in rows],
                "ratios": ratios,
                "target": {"cell": f"{TARGET_CELL[0]}@{TARGET_CELL[1]}", "min_ratio": TARGET_RATIO},
                "target_met": target_met,
                "config": {
                    "duration_s": args.duration,
                    "warmup": args.warmup,
                    "clients": levels,
                    "cpu_count": os.cpu_count(),
                },
                "notes": notes,
            }
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
        return 0
    finally:
        for server in reversed(servers):
            try:
                server.stop()
            except Exception as exc:
                print(f"warning: could not stop {server.name}: {exc!r}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
