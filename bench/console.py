"""Console benchmark: what an open web console costs the control plane, and how fast it sees a change.

Usage::

    python bench/console.py [--nodes 64] [--window 10] [--json out.json]

``hyperpod-sim serve`` runs as a subprocess (fresh SQLite data dir, ``local`` provisioner: every
node a real agent process, heartbeats every 1 s) with one tiered cluster of ``--nodes`` nodes and
one checkpoint namespace, so that every view asks every agent for its index and its metrics. A
console is emulated by what its page does (hyperpod_sim/api/console/app.js): ``GET /clusters/{name}/overview``
every 0.5 s with ``If-None-Match``, and ``GET /faults`` every 1 s.

1. CPU of the control plane process (``/proc/<pid>/stat``) and of all agents over ``--window``
   seconds: with no console, with one, with four (views are shared: four should cost about one).
2. Update latency, 5 times each: from a checkpoint policy change (``PUT``: the database's part of
   the view) and from a new namespace on an agent (the agents' part) until the polling console
   holds a view showing it.
3. The console's weight: the bytes of the static files it loads, as shipped and gzipped.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

import httpx

from bench.common import (
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    kill_leftover_agents,
    poll,
    progress,
    start_hpsim,
    stop_servers,
    table,
    wait_ready,
    with_notes,
    write_json,
)
from hyperpod_sim.domain.provisioning import find_agent_pids

STATIC = Path(__file__).resolve().parent.parent / "hyperpod_sim" / "api" / "console"
SETTINGS = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "1",
    "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
    "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
    "HPSIM_S3__EMBEDDED": "off",
}
NAME = "console-bench"


class Console(threading.Thread):
    """What one open console page does, until ``stop``: counts answers and keeps the last view."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.stopped = threading.Event()
        self.answers = {200: 0, 304: 0}
        self.bytes = 0
        self.view: dict[str, Any] | None = None
        self.seen_at = 0.0

    def run(self) -> None:
        etag = None
        last_faults = 0.0
        with httpx.Client(base_url=self.endpoint, timeout=30) as http:
            while not self.stopped.is_set():
                started = time.monotonic()
                response = http.get(f"/clusters/{NAME}/overview", headers={"If-None-Match": etag or ""})
                self.answers[response.status_code] = self.answers.get(response.status_code, 0) + 1
                if response.status_code == 200:
                    etag = response.headers["ETag"]
                    self.bytes += len(response.content)
                    self.view = response.json()
                    self.seen_at = time.monotonic()
                if started - last_faults >= 1.0:
                    http.get("/faults")
                    last_faults = started
                self.stopped.wait(max(0.0, 0.5 - (time.monotonic() - started)))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


def cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


def measure(server_pid: int, agents: list[int], window_s: float, consoles: list[Console]) -> dict[str, Any]:
    for console in consoles:
        console.start()
    time.sleep(1.0)  # the first views computed: measure the steady state
    server0, agents0, t0 = cpu([server_pid]), cpu(agents), time.monotonic()
    time.sleep(window_s)
    server1, agents1, t1 = cpu([server_pid]), cpu(agents), time.monotonic()
    for console in consoles:
        console.stop()
    answers = {k: sum(c.answers.get(k, 0) for c in consoles) for k in (200, 304)}
    return {
        "consoles": len(consoles),
        "server_cpu_pct": 100 * (server1 - server0) / (t1 - t0),
        "agents_cpu_pct": 100 * (agents1 - agents0) / (t1 - t0),
        "answers_200": answers[200],
        "answers_304": answers[304],
        "view_bytes": consoles[0].bytes // max(1, consoles[0].answers[200]) if consoles else 0,
    }


def update_latency(endpoint: str, agent: str, repeats: int) -> dict[str, list[float]]:
    """Seconds from a change until the polling console holds a view showing it: a checkpoint
    policy change (the database's part) and a new namespace on an agent (the agents' part)."""
    console = Console(endpoint)
    console.start()
    found: dict[str, list[float]] = {"policy": [], "namespace": []}
    try:
        for i in range(repeats):
            retention = 2 + i % 2
            changes = [
                (
                    "policy",
                    lambda r=retention: httpx.put(
                        f"{endpoint}/clusters/{NAME}/checkpoint-policy", json={"InMemoryRetention": r}
                    ),
                    lambda view, r=retention: view["CheckpointPolicy"]["InMemoryRetention"] == r,
                ),
                (
                    "namespace",
                    lambda i=i: httpx.post(f"{agent}/v1/cp/namespaces/lat{i}", params={"num_ranks": 1}),
                    lambda view, i=i: any(ns["Namespace"] == f"lat{i}" for ns in view["Checkpoints"]),
                ),
            ]
            for kind, change, shows in changes:
                # A policy change is accepted InService only: the previous rollout must be over.
                poll(
                    lambda: True if console.view and console.view["ClusterStatus"] == "InService" else None,
                    120,
                    0.05,
                    lambda: TimeoutError("the cluster stayed Updating"),
                )
                started = time.monotonic()
                change().raise_for_status()

                def seen(shows: Any = shows) -> bool | None:
                    view = console.view
                    return True if view is not None and shows(view) else None

                poll(seen, 30, 0.005, lambda: TimeoutError("the console never saw the change"))
                found[kind].append(console.seen_at - started)
                time.sleep(0.6)  # the next change lands at another point of the poll cycle
    finally:
        console.stop()
    return found


def weight() -> tuple[int, int]:
    files = [STATIC / name for name in ("index.html", "app.js", "api.js", "views.js", "style.css")]
    raw = sum(f.stat().st_size for f in files)
    return raw, sum(len(gzip.compress(f.read_bytes())) for f in files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="hpsim-bench-console-"))
    settings = {**SETTINGS, "HPSIM_SIMULATION__SHM_ROOT": str(workdir / "shm")}
    server = start_hpsim(workdir, settings)
    try:
        wait_ready(server, 60)
        endpoint = server.endpoint
        progress(f"creating a {args.nodes}-node cluster")
        httpx.post(
            f"{endpoint}/clusters",
            json={
                "ClusterName": NAME,
                "InstanceGroups": [
                    {
                        "InstanceGroupName": "workers",
                        "InstanceType": "ml.g5.2xlarge",
                        "InstanceCount": args.nodes,
                        "ExecutionRole": "arn:aws:iam::123456789012:role/hp",
                    }
                ],
                "Orchestrator": {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/b"}},
                "TieredStorageConfig": {"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
            },
        ).raise_for_status()

        def in_service() -> dict[str, Any] | None:
            server.check_alive()
            view: dict[str, Any] = httpx.get(f"{endpoint}/clusters/{NAME}/overview", timeout=30).json()
            return view if view["ClusterStatus"] == "InService" else None

        view = poll(in_service, 300, 0.5, lambda: TimeoutError("the cluster never got InService"))
        agent = view["Nodes"][0]["Endpoint"]
        httpx.post(f"{agent}/v1/cp/namespaces/job", params={"num_ranks": args.nodes}).raise_for_status()
        agents = [pid for node in view["Nodes"] for pid in find_agent_pids(node["InstanceId"])]
        rows = []
        for count in (0, 1, 4):
            progress(f"{count} console(s) open for {args.window:.0f} s")
            consoles = [Console(endpoint) for _ in range(count)]
            rows.append(measure(server.proc.pid, agents, args.window, consoles))
        progress("update latency")
        latencies = update_latency(endpoint, agent, 5)
    finally:
        stop_servers([server])
        kill_leftover_agents(workdir)
    raw, zipped = weight()
    lines = table(
        f"{'consoles':>8}  {'control plane CPU':>17}  {'agents CPU':>10}  {'200s':>5}  {'304s':>5}"
        f"  {'view':>9}",
        [
            f"{r['consoles']:>8}  {fmt(r['server_cpu_pct'], '.1f'):>16}%"
            f"  {fmt(r['agents_cpu_pct'], '.1f'):>9}%  {r['answers_200']:>5}  {r['answers_304']:>5}"
            f"  {r['view_bytes']:>7} B"
            for r in rows
        ],
    )
    notes = [
        f"{args.nodes} nodes, one namespace; CPU of one core in %, over {args.window:.0f} s",
        *(
            f"update latency, {kind} (the change -> the console holds a view showing it): median "
            f"{statistics.median(seconds):.2f} s, max {max(seconds):.2f} s"
            for kind, seconds in latencies.items()
        ),
        f"weight: {raw} bytes shipped ({zipped} gzipped), no other request but the API's",
    ]
    print(with_notes(lines, notes))
    if args.json:
        write_json(args.json, {"nodes": args.nodes, "rows": rows, "latencies_s": latencies,
                               "weight_bytes": raw, "weight_gzip_bytes": zipped})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
