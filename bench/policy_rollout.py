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
   ``domain.provisioning.find_agent_pids``), and the control plane's.
5. DeleteCluster, then wait until the cluster is gone and its agent processes have exited.

Server and agent CPU per rollout come from ``/proc/<pid>/stat`` around each measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from domain.provisioning import find_agent_pids

HOST = "127.0.0.1"
REGION = "us-east-1"
INSTANCE_TYPE = "ml.p5.48xlarge"
GROUP = "workers"
FIRST_PERCENTAGE = 20
TARGET_SIZES = (1, 64)
TARGET_MAX_RATIO = 10.0
POLL_INTERVAL_S = 0.002
CREATE_POLL_INTERVAL_S = 0.05
MIB = 1024 * 1024

ORCHESTRATOR = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/bench"}}
EXECUTION_ROLE = "arn:aws:iam::123456789012:role/hp"

CLIENT_CONFIG = Config(
    retries={"total_max_attempts": 1, "mode": "standard"},
    connect_timeout=5,
    read_timeout=60,
)


# ---------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_sum(pids: list[int]) -> float:
    return sum(c for c in (cpu_seconds(p) for p in pids) if c is not None)


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def agent_pids_under(workdir: Path) -> list[int]:
    """Agent processes whose command line mentions ``workdir`` (their --data-dir is inside it)."""
    marker = str(workdir).encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if marker in cmdline and b"agent\0" in cmdline:
            pids.append(int(entry.name))
    return pids


def kill_leftover_agents(workdir: Path, grace_s: float = 5.0) -> int:
    """SIGTERM, then SIGKILL, the agent processes this run left behind; how many there were."""
    pids = agent_pids_under(workdir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return len(pids)


@dataclass
class Server:
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
                f"hyperpod-sim exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)


def _hpsim_command() -> list[str]:
    script = Path(sys.executable).parent / "hyperpod-sim"
    if script.exists():
        return [str(script)]
    found = shutil.which("hyperpod-sim")
    return [found] if found else [sys.executable, "-m", "hyperpod_sim"]


def start_server(workdir: Path) -> Server:
    port = free_port()
    env = dict(os.environ)
    env.update(
        {
            "HPSIM_PROVISIONING__MODE": "local",
            "HPSIM_PROVISIONING__HEARTBEAT_INTERVAL_S": "1",
            "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
            "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
            "HPSIM_LIMITS__MAX_INSTANCES_PER_CLUSTER": "1000",
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
        str(workdir / "hpsim-data"),
        "--log-level",
        "warning",
    ]
    log_path = workdir / "hpsim.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; `finally` stops the server and agents.
        )
    return Server(port=port, proc=proc, log_path=log_path)


def wait_ready(server: Server, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    last_error = "no attempt"
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            with urllib.request.urlopen(f"{server.endpoint}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
                last_error = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"HTTP {exc.code}"
        except (OSError, urllib.error.URLError) as exc:
            last_error = repr(exc)
        time.sleep(0.1)
    raise TimeoutError(
        f"hyperpod-sim not ready within {deadline_s}s ({last_error}); log tail:\n{server.log_tail()}"
    )


# ---------------------------------------------------------------------- clients


def make_client(endpoint: str) -> Any:
    return boto3.session.Session().client(
        "sagemaker",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="x",
        aws_secret_access_key="y",
        config=CLIENT_CONFIG,
    )


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def capture_describe_headers(client: Any, cluster_name: str) -> tuple[tuple[str, str], ...]:
    """The headers boto3 sends for DescribeCluster (without Host, Accept-Encoding, Content-Length,
    which http.client adds), recorded by a ``before-send`` hook around one real call."""
    captured: list[tuple[tuple[str, str], ...]] = []

    def record(request: Any, **_: Any) -> None:
        captured.append(
            tuple(
                (_text(k), _text(v))
                for k, v in request.headers.items()
                if k.lower() not in ("host", "accept-encoding", "content-length")
            )
        )

    client.meta.events.register("before-send.sagemaker.DescribeCluster", record)
    try:
        client.describe_cluster(ClusterName=cluster_name)
    except ClientError:
        pass  # ResourceNotFound is fine: only the request matters
    finally:
        client.meta.events.unregister("before-send.sagemaker.DescribeCluster", record)
    if not captured or dict(captured[0]).get("X-Amz-Target") != "SageMaker.DescribeCluster":
        raise RuntimeError("could not record boto3's DescribeCluster request")
    return captured[0]


class RawDescribe:
    """DescribeCluster over one keep-alive ``http.client`` connection, replaying boto3's headers."""

    def __init__(self, port: int, headers: tuple[tuple[str, str], ...], cluster_name: str) -> None:
        self.port = port
        self.headers = headers
        self.body = json.dumps({"ClusterName": cluster_name}).encode()  # as botocore serialises it
        self.conn = http.client.HTTPConnection(HOST, port, timeout=30)

    def _send(self) -> tuple[int, bytes]:
        conn = self.conn
        conn.putrequest("POST", "/")
        for name, value in self.headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(self.body)))
        conn.endheaders(self.body)
        resp = conn.getresponse()
        return resp.status, resp.read()

    def status(self) -> str:
        """The cluster's ClusterStatus; reconnects once if the server closed an idle connection."""
        try:
            code, data = self._send()
        except (http.client.HTTPException, ConnectionError):
            self.conn.close()
            self.conn = http.client.HTTPConnection(HOST, self.port, timeout=30)
            code, data = self._send()
        if code != 200:
            raise RuntimeError(f"DescribeCluster: HTTP {code}: {data[:300]!r}")
        status: str = json.loads(data)["ClusterStatus"]
        return status

    def close(self) -> None:
        self.conn.close()


def http_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


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
                "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-bench/lc/", "OnCreate": "on_create.sh"},
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
    deadline = time.monotonic() + deadline_s
    polls = 0
    while True:
        status = raw.status()
        polls += 1
        if status == want:
            return time.perf_counter(), polls
        if status not in ("Creating", "Updating"):
            raise RuntimeError(
                f"cluster is {status} while waiting for {want}; log tail:\n{server.log_tail()}"
            )
        if time.monotonic() > deadline:
            server.check_alive()
            raise TimeoutError(f"cluster still {status} after {deadline_s}s (waiting for {want})")
        time.sleep(interval_s)


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
    deadline = started + deadline_s
    gone = False
    while True:
        if not gone:
            try:
                client.describe_cluster(ClusterName=name)
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "ResourceNotFound":
                    raise
                gone = True
        if gone and not any(find_agent_pids(n) for n in node_ids):
            return time.monotonic() - started
        if time.monotonic() > deadline:
            server.check_alive()
            left = sum(len(find_agent_pids(n)) for n in node_ids)
            raise TimeoutError(
                f"{name}: {'gone' if gone else 'still described'}, {left} agent process(es) left "
                f"after {deadline_s}s"
            )
        time.sleep(0.1)


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
    headers: tuple[tuple[str, str], ...],
    size: int,
    repeats: int,
    create_timeout_s: float,
    rollout_timeout_s: float,
) -> Row:
    name = f"bench-rollout-{size}"
    raw = RawDescribe(server.port, headers, name)
    try:
        started = time.perf_counter()
        create_cluster(client, name, size)
        in_service, _ = wait_status(raw, server, "InService", create_timeout_s, CREATE_POLL_INTERVAL_S)
        create_s = in_service - started
        node_ids = list_node_ids(client, name)
        if len(node_ids) != size:
            raise RuntimeError(f"{name}: {len(node_ids)} nodes listed, expected {size}")
        generation = verify_rollout(server, name, node_ids, None, FIRST_PERCENTAGE)
        node_pids = {n: find_agent_pids(n) for n in node_ids}
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
            print(
                f"  {size:>3} nodes, rollout {i + 1}/{repeats}: {rollouts[-1]:8.1f} ms "
                f"(generation {generation}, {percentage} %)",
                file=sys.stderr,
                flush=True,
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


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def render(rows: list[Row], base: int, target_line: str | None, notes: list[str]) -> str:
    header = (
        f"{'nodes':>5} {'create s':>9} {'median ms':>10} {'min ms':>8} {f'x {base}-node':>10} "
        f"{'call ms':>8} {'polls':>6} {'srv CPU ms':>10} {'agt CPU ms':>10} {'agt RSS MiB':>12} "
        f"{'max MiB':>8} {'srv RSS MiB':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.nodes:>5} {r.create_s:>9.2f} {r.median_ms:>10.1f} {r.min_ms:>8.1f} "
            f"{_fmt(r.ratio_to_base, '.2f'):>10} {r.update_call_ms:>8.1f} {r.polls:>6.0f} "
            f"{_fmt(r.server_cpu_ms, '.0f'):>10} {r.agents_cpu_ms:>10.0f} {r.agent_rss_mean_mib:>12.1f} "
            f"{r.agent_rss_max_mib:>8.1f} {_fmt(r.server_rss_mib, '.1f'):>12}"
        )
    lines.append("")
    if target_line:
        lines.append(target_line)
        lines.append("")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
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
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--sizes must list positive integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1 or max(sizes) > 1000 or args.repeats < 1:
        parser.error("--sizes must list integers in 1..1000 and --repeats be >= 1")

    # SIGTERM (a timeout wrapper, a CI cancel) unwinds like Ctrl-C, so `finally` stops the agents.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="hpsim-rollout-"))
    server: Server | None = None
    try:
        server = start_server(workdir)
        wait_ready(server, args.startup_timeout)
        client = make_client(server.endpoint)
        client.list_clusters()  # load botocore's model outside any measurement
        # boto3's DescribeCluster headers, recorded once (the cluster need not exist).
        headers = capture_describe_headers(client, "bench-rollout-capture")

        rows: list[Row] = []
        for size in sizes:
            row = measure_size(
                client, server, headers, size, args.repeats, args.create_timeout, args.rollout_timeout
            )
            rows.append(row)
            print(
                f"  measured {size} nodes: create {row.create_s:.1f} s, rollout median "
                f"{row.median_ms:.1f} ms, delete {row.delete_s:.1f} s",
                file=sys.stderr,
                flush=True,
            )

        base = rows[0]
        for r in rows:
            r.ratio_to_base = round(r.median_ms / base.median_ms, 3) if base.median_ms > 0 else None
        by_size = {r.nodes: r for r in rows}
        small, large = TARGET_SIZES
        target_ratio: float | None = None
        target_met: bool | None = None
        target_line = None
        if small in by_size and large in by_size and by_size[small].median_ms > 0:
            target_ratio = round(by_size[large].median_ms / by_size[small].median_ms, 3)
            target_met = target_ratio < TARGET_MAX_RATIO
            target_line = (
                f"ratio {large} nodes / {small} node: {target_ratio:.1f}x (target < {TARGET_MAX_RATIO:g}x)"
                f"{'' if target_met else '  NOT MET'}"
            )

        notes = [
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
            f"{args.repeats} rollout(s) per size, percentages 30, 40, ...; medians and mins over them.",
        ]
        print(render(rows, base.nodes, target_line, notes))
        if args.json:
            payload = {
                "rows": [asdict(r) for r in rows],
                "base_nodes": base.nodes,
                "target": {"sizes": list(TARGET_SIZES), "max_ratio": TARGET_MAX_RATIO},
                "ratio": target_ratio,
                "target_met": target_met,
                "config": {
                    "sizes": sizes,
                    "repeats": args.repeats,
                    "poll_interval_ms": POLL_INTERVAL_S * 1000,
                    "heartbeat_interval_s": 1,
                    "instance_type": INSTANCE_TYPE,
                    "cpu_count": os.cpu_count(),
                },
                "notes": notes,
            }
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
        return 0
    finally:
        if server is not None:
            try:
                server.stop()
            except Exception as exc:
                print(f"warning: could not stop hyperpod-sim: {exc!r}", file=sys.stderr)
        left = kill_leftover_agents(workdir)
        if left:
            print(f"  stopped {left} leftover agent process(es)", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
