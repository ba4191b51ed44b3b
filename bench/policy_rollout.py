"""Policy rollout benchmark: time from UpdateCluster to every node acknowledging the new policy.

Usage::

    python bench/policy_rollout.py [--sizes 1,8,32,64] [--repeats 3] [--json out.json]

``hyperpod-sim serve`` runs as a subprocess on a free loopback port with a fresh temporary data dir
(SQLite) and the ``local`` provisioner: every cluster node is a real ``hyperpod-sim agent`` process
on this machine. Heartbeats every 1 s; the heartbeat timeout is raised to 60 s and the launch
timeout to 300 s (dozens of agent processes starting on two cores are slow, and must not be
declared failed and replaced mid-measurement); the per-cluster instance limit is raised.

For each size N, one size at a time:

1. CreateCluster (boto3): one instance group of N ``ml.p5.48xlarge`` nodes, EKS orchestrator,
   ``TieredStorageConfig`` enabled at 20 %. The creation time runs from just before the call until
   DescribeCluster reports ``InService`` (it includes N agent process starts and registrations).
2. Per repeat: UpdateCluster (boto3) changing only ``InstanceMemoryAllocationPercentage``
   (30, 40, ...). The rollout time runs from just before the call until DescribeCluster reports
   ``InService`` again: the control plane goes Updating -> InService only once every node has
   acknowledged the new policy generation (its agent answered the push, or heartbeated it).
   DescribeCluster is polled every 2 ms over one keep-alive ``http.client`` connection that replays
   the request boto3 sends (``POST /``, ``X-Amz-Target: SageMaker.DescribeCluster``, recorded once
   with a ``before-send`` hook), so polling costs little CPU on the shared cores.
3. After each rollout, a correctness check (not timed): for every node (ListClusterNodes), the REST
   ``GET /clusters/{name}/nodes/{id}`` reports ``AgentStatus`` with applied == desired == the
   expected generation (one more than before the update), and the agent's own ``GET /v1/policy``
   at ``AgentStatus.Endpoint`` returns that generation with the new percentage. Any mismatch
   aborts the run.
4. Agent RSS: ``VmRSS`` from ``/proc/<pid>/status`` of every agent process of the cluster (pids by
   ``infra.processes.find_agent_pids``), and the control plane's.
5. DeleteCluster, then wait until the cluster is gone and its agent processes have exited.

Server and agent CPU per rollout come from ``/proc/<pid>/stat`` around each measurement.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import (
    MIB,
    RawClient,
    Server,
    WireRecorder,
    WireRequest,
    cpu_seconds,
    fmt,
    http_json,
    int_list_option,
    poll,
    progress,
    rss_bytes,
    sagemaker_client,
    table,
    with_notes,
)
from bench.runner import (
    EXECUTION_ROLE,
    INSTANCE_TYPE,
    LIFECYCLE,
    ORCHESTRATOR,
    BenchRun,
    Cell,
    Target,
    finish,
    node_agent_pids,
)

GROUP = "workers"
FIRST_PERCENTAGE = 20
TARGET_SIZES = (1, 64)
TARGET = Target("<", 10.0)
POLL_INTERVAL_S = 0.002
CREATE_POLL_INTERVAL_S = 0.05


# Dozens of agent processes starting on two cores are slow: they must not be declared failed and
# replaced mid-measurement. Heartbeats every 1 s; the per-cluster instance limit raised.
HPSIM_SETTINGS = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "1",
    "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
    "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
    "HPSIM_LIMITS__MAX_INSTANCES_PER_CLUSTER": "1000",
}


# ---------------------------------------------------------------------- processes


def cpu_sum(pids: list[int]) -> float:
    return sum(c for c in (cpu_seconds(p) for p in pids) if c is not None)


# ---------------------------------------------------------------------- clients


def make_client(endpoint: str) -> Any:
    return sagemaker_client(endpoint, connect_timeout=5, read_timeout=60)


def capture_describe(client: Any, cluster_name: str) -> WireRequest:
    """The DescribeCluster request boto3 sends (headers without Host, Accept-Encoding,
    Content-Length, which http.client adds), recorded by a ``before-send`` hook around one real
    call."""
    recorder = WireRecorder(client, "DescribeCluster")
    try:
        client.describe_cluster(ClusterName=cluster_name)
    except ClientError:
        pass  # ResourceNotFound is fine: only the request matters
    finally:
        recorder.stop()
    wire = recorder.captured.get("DescribeCluster")
    if wire is None or dict(wire.headers).get("X-Amz-Target") != "SageMaker.DescribeCluster":
        raise RuntimeError("could not record boto3's DescribeCluster request")
    return wire


class RawDescribe:
    """DescribeCluster over one keep-alive ``http.client`` connection, replaying boto3's request."""

    def __init__(self, port: int, wire: WireRequest, cluster_name: str) -> None:
        self.raw = RawClient(port, wire)
        self.body = self.raw.body(cluster_name)  # {"ClusterName": ...}, as botocore serialises it

    def status(self) -> str:
        """The cluster's ClusterStatus; reconnects once if the server closed an idle connection."""
        try:
            code, data = self.raw.send(self.body)
        except (http.client.HTTPException, ConnectionError):
            self.raw.close()  # the next request opens a new connection
            code, data = self.raw.send(self.body)
        if code != 200:
            raise RuntimeError(f"DescribeCluster: HTTP {code}: {data[:300]!r}")
        status: str = json.loads(data)["ClusterStatus"]
        return status

    def close(self) -> None:
        self.raw.close()


def tiered_storage(percentage: int) -> dict[str, Any]:
    return {"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage}


def create_cluster(client: Any, name: str, size: int) -> None:
    client.create_cluster(
        ClusterName=name,
        InstanceGroups=[
            {
                "InstanceGroupName": GROUP,
                "InstanceType": INSTANCE_TYPE,
                "InstanceCount": size,
                "ExecutionRole": EXECUTION_ROLE,
                "LifeCycleConfig": LIFECYCLE,
            }
        ],
        Orchestrator=ORCHESTRATOR,
        TieredStorageConfig=tiered_storage(FIRST_PERCENTAGE),
    )


def wait_status(
    raw: RawDescribe, server: Server, want: str, deadline_s: float, interval_s: float
) -> tuple[float, int]:
    """Poll until ClusterStatus is ``want``; the perf_counter() of the answer that said so, and how
    many DescribeCluster calls it took."""
    polls = 0
    status = ""

    def reached() -> float | None:
        nonlocal polls, status
        status = raw.status()
        polls += 1
        if status == want:
            return time.perf_counter()
        if status not in ("Creating", "Updating"):
            raise RuntimeError(
                f"cluster is {status} while waiting for {want}; log tail:\n{server.log_tail()}"
            )
        return None

    def timed_out() -> TimeoutError:
        server.check_alive()
        return TimeoutError(f"cluster still {status} after {deadline_s}s (waiting for {want})")

    done = poll(reached, deadline_s, interval_s, timed_out)
    return done, polls


def list_node_ids(client: Any, name: str) -> list[str]:
    ids: list[str] = []
    kwargs: dict[str, Any] = {"ClusterName": name}
    while True:
        page = client.list_cluster_nodes(**kwargs)
        ids.extend(n["InstanceId"] for n in page["ClusterNodeSummaries"])
        token = page.get("NextToken")
        if not token:
            return ids
        kwargs["NextToken"] = token


def verify_rollout(
    server: Server, name: str, node_ids: list[str], expected_generation: int | None, percentage: int
) -> int:
    """Check every node's AgentStatus and its agent's applied policy; the generation found.

    ``expected_generation`` None: whatever the control plane desires, as long as all agree.
    Raises RuntimeError on any mismatch.
    """
    problems: list[str] = []
    generations: set[int] = set()
    for node_id in node_ids:
        details = http_json(f"{server.endpoint}/clusters/{name}/nodes/{node_id}")
        details = details.get("NodeDetails", details)
        agent = details.get("AgentStatus") or {}
        desired, applied, endpoint = (
            agent.get("DesiredPolicyGeneration"),
            agent.get("AppliedPolicyGeneration"),
            agent.get("Endpoint"),
        )
        want = expected_generation if expected_generation is not None else desired
        if not isinstance(want, int) or desired != want or applied != want or not endpoint:
            problems.append(f"{node_id}: AgentStatus {agent!r}, expected generation {want}")
            continue
        generations.add(want)
        policy = http_json(f"{endpoint}/v1/policy")
        got_pct = (policy.get("tiered_storage") or {}).get("memory_percentage")
        if policy.get("generation") != want or got_pct != percentage or policy.get("node_id") != node_id:
            problems.append(
                f"{node_id}: agent at {endpoint} has generation {policy.get('generation')} "
                f"(expected {want}), memory_percentage {got_pct} (expected {percentage}), "
                f"node_id {policy.get('node_id')}"
            )
    if len(generations) > 1:
        problems.append(f"nodes disagree on the desired generation: {sorted(generations)}")
    if problems:
        shown = "\n  ".join(problems[:10])
        raise RuntimeError(f"rollout check failed on {len(problems)} node(s) of {name}:\n  {shown}")
    return generations.pop()


def wait_deleted(client: Any, server: Server, name: str, node_ids: list[str], deadline_s: float) -> float:
    """Wait until DescribeCluster says ResourceNotFound and every agent process has exited; seconds."""
    started = time.monotonic()
    gone = False

    def finished() -> float | None:
        nonlocal gone
        if not gone:
            try:
                client.describe_cluster(ClusterName=name)
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "ResourceNotFound":
                    raise
                gone = True
        if gone and not any(node_agent_pids(n) for n in node_ids):
            return time.monotonic() - started
        return None

    def timed_out() -> TimeoutError:
        server.check_alive()
        left = sum(len(node_agent_pids(n)) for n in node_ids)
        return TimeoutError(
            f"{name}: {'gone' if gone else 'still described'}, {left} agent process(es) left "
            f"after {deadline_s}s"
        )

    return poll(finished, deadline_s, 0.1, timed_out)


# ---------------------------------------------------------------------- measurement


@dataclass
class Row:
    nodes: int
    create_s: float
    rollouts_ms: list[float]
    median_ms: float
    min_ms: float
    ratio_to_base: float | None
    update_call_ms: float
    polls: float
    server_cpu_ms: float | None
    agents_cpu_ms: float
    agent_processes: int
    agent_rss_mean_mib: float
    agent_rss_max_mib: float
    server_rss_mib: float | None
    delete_s: float
    generations: list[int] = field(default_factory=list)


def measure_size(
    client: Any,
    server: Server,
    describe: WireRequest,
    size: int,
    repeats: int,
    create_timeout_s: float,
    rollout_timeout_s: float,
) -> Row:
    name = f"bench-rollout-{size}"
    raw = RawDescribe(server.port, describe, name)
    try:
        started = time.perf_counter()
        create_cluster(client, name, size)
        in_service, _ = wait_status(raw, server, "InService", create_timeout_s, CREATE_POLL_INTERVAL_S)
        create_s = in_service - started
        node_ids = list_node_ids(client, name)
        if len(node_ids) != size:
            raise RuntimeError(f"{name}: {len(node_ids)} nodes listed, expected {size}")
        generation = verify_rollout(server, name, node_ids, None, FIRST_PERCENTAGE)
        node_pids = {n: node_agent_pids(n) for n in node_ids}
        missing = [n for n, pids in node_pids.items() if not pids]
        if missing:
            raise RuntimeError(f"{name}: no agent process found for {missing[:5]}")
        agent_pids = [p for pids in node_pids.values() for p in pids]

        rollouts: list[float] = []
        calls: list[float] = []
        poll_counts: list[int] = []
        server_cpu: list[float] = []
        agents_cpu: list[float] = []
        generations = [generation]
        for i in range(repeats):
            percentage = FIRST_PERCENTAGE + 10 * (i % 8 + 1)  # 30, 40, ... 100, then 30 again
            time.sleep(0.2)  # let the previous check's traffic settle
            raw.status()  # (re)open the keep-alive connection outside the measurement
            srv_before, agents_before = cpu_seconds(server.proc.pid), cpu_sum(agent_pids)
            t0 = time.perf_counter()
            client.update_cluster(ClusterName=name, TieredStorageConfig=tiered_storage(percentage))
            t_call = time.perf_counter()
            t_done, polls = wait_status(raw, server, "InService", rollout_timeout_s, POLL_INTERVAL_S)
            srv_after, agents_after = cpu_seconds(server.proc.pid), cpu_sum(agent_pids)
            rollouts.append((t_done - t0) * 1000)
            calls.append((t_call - t0) * 1000)
            poll_counts.append(polls)
            if srv_before is not None and srv_after is not None:
                server_cpu.append((srv_after - srv_before) * 1000)
            agents_cpu.append((agents_after - agents_before) * 1000)
            generation = verify_rollout(server, name, node_ids, generation + 1, percentage)
            generations.append(generation)
            progress(
                f"  {size:>3} nodes, rollout {i + 1}/{repeats}: {rollouts[-1]:8.1f} ms "
                f"(generation {generation}, {percentage} %)"
            )

        rss = [r for r in (rss_bytes(p) for p in agent_pids) if r is not None]
        if len(rss) != len(agent_pids):
            raise RuntimeError(f"{name}: {len(agent_pids) - len(rss)} agent process(es) vanished")
        server_rss = rss_bytes(server.proc.pid)

        client.delete_cluster(ClusterName=name)
        delete_s = wait_deleted(client, server, name, node_ids, deadline_s=120)
    finally:
        raw.close()

    return Row(
        nodes=size,
        create_s=round(create_s, 2),
        rollouts_ms=[round(r, 2) for r in rollouts],
        median_ms=round(statistics.median(rollouts), 2),
        min_ms=round(min(rollouts), 2),
        ratio_to_base=None,
        update_call_ms=round(statistics.median(calls), 2),
        polls=statistics.median(poll_counts),
        server_cpu_ms=round(statistics.median(server_cpu), 1) if server_cpu else None,
        agents_cpu_ms=round(statistics.median(agents_cpu), 1),
        agent_processes=len(agent_pids),
        agent_rss_mean_mib=round(statistics.fmean(rss) / MIB, 1),
        agent_rss_max_mib=round(max(rss) / MIB, 1),
        server_rss_mib=None if server_rss is None else round(server_rss / MIB, 1),
        delete_s=round(delete_s, 2),
        generations=generations,
    )


# ---------------------------------------------------------------------- report


def render(rows: list[Row], base: int, target_line: str | None, notes: list[str]) -> str:
    header = (
        f"{'nodes':>5} {'create s':>9} {'median ms':>10} {'min ms':>8} {f'x {base}-node':>10} "
        f"{'call ms':>8} {'polls':>6} {'srv CPU ms':>10} {'agt CPU ms':>10} {'agt RSS MiB':>12} "
        f"{'max MiB':>8} {'srv RSS MiB':>12}"
    )
    lines = table(header)
    for r in rows:
        lines.append(
            f"{r.nodes:>5} {r.create_s:>9.2f} {r.median_ms:>10.1f} {r.min_ms:>8.1f} "
            f"{fmt(r.ratio_to_base, '.2f'):>10} {r.update_call_ms:>8.1f} {r.polls:>6.0f} "
            f"{fmt(r.server_cpu_ms, '.0f'):>10} {r.agents_cpu_ms:>10.0f} {r.agent_rss_mean_mib:>12.1f} "
            f"{r.agent_rss_max_mib:>8.1f} {fmt(r.server_rss_mib, '.1f'):>12}"
        )
    if target_line:
        lines += ["", target_line]
    return with_notes(lines, notes)


def notes_of(repeats: int) -> list[str]:
    """The notes printed under the table (and kept in the JSON)."""
    return [
        "complete = the control plane's own verdict: DescribeCluster reports InService again after "
        "UpdateCluster (Updating -> InService happens only once every node acknowledged the new "
        "policy generation); rollout time runs from just before the boto3 update_cluster call to the "
        "first DescribeCluster answer that says InService. After each rollout every node's "
        "AgentStatus (REST) and every agent's GET /v1/policy were checked to hold the new generation "
        "and percentage (untimed).",
        f"polling: DescribeCluster every {POLL_INTERVAL_S * 1000:g} ms over one keep-alive http.client "
        "connection replaying boto3's request (X-Amz-Target: SageMaker.DescribeCluster); creation "
        f"polled every {CREATE_POLL_INTERVAL_S * 1000:g} ms. polls = DescribeCluster calls in one "
        "rollout (median); each costs the server about half a millisecond of CPU (control_plane.py), "
        "counted in srv CPU ms and taken from the rollout's share of the cores.",
        f"the control plane, all agents and this script share this machine's {os.cpu_count()} CPU(s); "
        "agents heartbeat every 1 s (a SQLite write each) throughout, so larger clusters also load "
        "the server between rollouts.",
        "create s includes N agent process starts and registrations; call ms is the UpdateCluster "
        "call itself (boto3); srv/agt CPU ms are the median CPU time of the server process and of "
        "all agents together during one rollout, polling included (from /proc, in "
        f"{1000 // os.sysconf('SC_CLK_TCK')} ms ticks).",
        "agt RSS MiB: mean VmRSS of the cluster's agent processes after its rollouts (max next to "
        "it); srv RSS MiB: the control plane's VmRSS at the same moment.",
        f"{repeats} rollout(s) per size, percentages 30, 40, ...; medians and mins over them.",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="1,8,32,64", help="comma-separated cluster sizes (default 1,8,32,64)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rollouts per size (default 3)")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds to wait for the server")
    parser.add_argument(
        "--create-timeout", type=float, default=300.0, help="seconds for a cluster to be InService"
    )
    parser.add_argument("--rollout-timeout", type=float, default=120.0, help="seconds for one rollout")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.sizes = int_list_option(parser, "--sizes", args.sizes)
    if not args.sizes or min(args.sizes) < 1 or max(args.sizes) > 1000 or args.repeats < 1:
        parser.error("--sizes must list integers in 1..1000 and --repeats be >= 1")
    return args


def target_cell(rows: list[Row]) -> Cell | None:
    """The one ratio judged: the largest target size's median rollout over the smallest's (None
    when --sizes left either out)."""
    by_size = {r.nodes: r for r in rows}
    small, large = TARGET_SIZES
    if small not in by_size or large not in by_size or by_size[small].median_ms <= 0:
        return None
    ratio = round(by_size[large].median_ms / by_size[small].median_ms, 3)
    what = f"UpdateCluster -> all nodes acknowledged, {large}-node / {small}-node cluster"
    return Cell(what, ratio, TARGET)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with BenchRun("hpsim-rollout-") as run:
        server = run.serve(HPSIM_SETTINGS)
        run.ready(args.startup_timeout, server)
        client = make_client(server.endpoint)
        client.list_clusters()  # load botocore's model outside any measurement
        # boto3's DescribeCluster request, recorded once (the cluster need not exist).
        describe = capture_describe(client, "bench-rollout-capture")

        rows: list[Row] = []
        for size in args.sizes:
            row = measure_size(
                client, server, describe, size, args.repeats, args.create_timeout, args.rollout_timeout
            )
            rows.append(row)
            progress(
                f"  measured {size} nodes: create {row.create_s:.1f} s, rollout median "
                f"{row.median_ms:.1f} ms, delete {row.delete_s:.1f} s"
            )

        base = rows[0]
        for r in rows:
            r.ratio_to_base = round(r.median_ms / base.median_ms, 3) if base.median_ms > 0 else None
        cell = target_cell(rows)
        target_line = None
        if cell is not None:
            small, large = TARGET_SIZES
            target_line = (
                f"ratio {large} nodes / {small} node: {fmt(cell.value, '.1f')}x (target {cell.target})"
                f"{'' if cell.met else '  NOT MET'}"
            )
        notes = notes_of(args.repeats)
        payload = {
            "rows": [asdict(r) for r in rows],
            "base_nodes": base.nodes,
            "target": {"sizes": list(TARGET_SIZES), "max_ratio": TARGET.bound},
            "ratio": None if cell is None else cell.value,
            "target_met": None if cell is None else cell.met,
            "config": {
                "sizes": args.sizes,
                "repeats": args.repeats,
                "poll_interval_ms": POLL_INTERVAL_S * 1000,
                "heartbeat_interval_s": 1,
                "instance_type": INSTANCE_TYPE,
                "cpu_count": os.cpu_count(),
            },
            "notes": notes,
        }
        # No cell when --sizes left out either size of the target.
        report = render(rows, base.nodes, target_line, notes)
        return finish(report, [] if cell is None else [cell], args.json, payload)


if __name__ == "__main__":
    sys.exit(main())
