"""The runner every benchmark script in ``bench/`` runs its cells through.

A script says what it measures; this module does the rest the scripts used to do each on its own:

* :class:`BenchRun`: the run's temp dirs (and one in /dev/shm when asked), the servers it starts
  (``hyperpod-sim serve``, helper modes of the script itself), waiting until they answer, and on
  the way out stopping them, the agents their clusters started and whatever else was registered,
  then removing the dirs (SIGTERM unwinds like Ctrl-C, so this happens on a timeout too);
* clusters: :func:`create_tiered_cluster` and :func:`wait_in_service` wait through
  ``sdk.client.HyperPodClient.wait_until_in_service`` (the server's liveness checked at every
  poll), and hand back each node's agent (endpoint and process);
* timing: :func:`timed` (wall time, the servers' CPU and this process's) and :class:`Cpu` (CPU of
  some processes and of the rest of the machine over a stretch);
* the verdict: a :class:`Cell` is one ratio judged against its :class:`Target`; the printed
  ``(target >= 2x) met`` text and the JSON's ``target_ratios`` entries both come from it, and
  :func:`finish` prints the report and writes the JSON.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from bench.common import (
    HPSIM,
    Server,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    free_port,
    kill_leftover_agents,
    progress,
    ratio_vs_target,
    spawn,
    start_hpsim,
    stop_servers,
    wait_ready,
    write_json,
)

T = TypeVar("T")

EXECUTION_ROLE = "arn:aws:iam::123456789012:role/hp"
ORCHESTRATOR = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/bench"}}
LIFECYCLE = {"SourceS3Uri": "s3://sagemaker-bench/lc/", "OnCreate": "on_create.sh"}
INSTANCE_TYPE = "ml.p5.48xlarge"

# Agents started by the local provisioner on two busy cores must not look failed.
LOCAL_AGENTS = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
    "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
}


# ---------------------------------------------------------------------- the run


class BenchRun:
    """``with BenchRun("hpsim-tier-bench-", shm=True) as run:``: ``run.workdir`` (and
    ``run.shm_root``) exist inside; on exit every server started through the run is stopped (the
    last first), then the agents left under ``workdir``, then what ``on_exit`` registered (last
    first), and the dirs are removed."""

    def __init__(self, prefix: str, *, shm: bool = False, shm_prefix: str | None = None) -> None:
        self.prefix = prefix
        self.shm = shm
        self.shm_prefix = shm_prefix or prefix
        self.servers: list[Server] = []
        self._cleanups: list[Callable[[], None]] = []

    def __enter__(self) -> BenchRun:
        exit_on_sigterm()
        self.workdir = Path(tempfile.mkdtemp(prefix=self.prefix))
        self.shm_root = Path(tempfile.mkdtemp(prefix=self.shm_prefix, dir="/dev/shm")) if self.shm else None
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stop_servers(self.servers)
        left = kill_leftover_agents(self.workdir)
        for cleanup in reversed(self._cleanups):
            try:
                cleanup()
            except Exception as error:
                print(f"warning: cleanup failed: {error!r}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.shm_root is not None:
            shutil.rmtree(self.shm_root, ignore_errors=True)
        if left:
            with contextlib.suppress(OSError):  # stderr may be a closed pipe by now
                progress(f"  stopped {left} agent process(es)")

    def on_exit(self, cleanup: Callable[[], None]) -> None:
        """Call ``cleanup`` on the way out, after the servers and agents are stopped."""
        self._cleanups.append(cleanup)

    def add(self, server: Server) -> Server:
        """Stop ``server`` on the way out (with the others, the last added first)."""
        self.servers.append(server)
        return server

    def serve(self, settings: Mapping[str, str], *, subdir: str = "", name: str = HPSIM) -> Server:
        """``hyperpod-sim serve`` with ``settings`` (``bench.common.start_hpsim``), in
        ``workdir/subdir``; not waited for (see :meth:`ready`)."""
        return self.add(start_hpsim(self.workdir / subdir if subdir else self.workdir, settings, name))

    def helper(self, name: str, script: str, *args: str) -> Server:
        """``python script *args PORT``, a helper mode of a script listening on a free port (the
        port is its last argument), its output in ``workdir/<name>.log``; not waited for."""
        port = free_port()
        cmd = [sys.executable, script, *args, str(port)]
        return self.add(spawn(name, cmd, dict(os.environ), self.workdir / f"{name}.log", port))

    @staticmethod
    def ready(deadline_s: float, *servers: Server, path: str | None = "/health") -> None:
        """Wait until each server answers ``GET path`` (None: a TCP connect), ``deadline_s`` each."""
        for server in servers:
            wait_ready(server, deadline_s, path=path)


# ---------------------------------------------------------------------- clusters


@dataclass(frozen=True)
class NodeAgent:
    """One node of a cluster and the agent process serving it."""

    node_id: str
    endpoint: str
    pid: int


def node_agent_pids(node_id: str) -> list[int]:
    """The processes of the agent serving ``node_id`` (the one place bench/ asks the provisioner's
    process scan; ``infra.processes.find_agent_pids``)."""
    from hyperpod_sim.infra.processes import find_agent_pids

    return find_agent_pids(node_id)


def _client(server: Server) -> Any:
    from hyperpod_sim.sdk.client import HyperPodClient  # here: the scripts' helper processes never need boto3

    return HyperPodClient(server.endpoint, timeout_s=60)


def wait_in_service(server: Server, name: str, deadline_s: float, client: Any = None) -> None:
    """Until DescribeCluster says InService (``HyperPodClient.wait_until_in_service``); RuntimeError
    with the server's log tail if the cluster fails, the wait times out or the server exits."""
    from hyperpod_sim.sdk.client import ClusterError

    own = client is None
    client = _client(server) if own else client
    try:
        client.wait_until_in_service(name, timeout=deadline_s, on_poll=lambda _: server.check_alive())
    except ClusterError as exc:
        raise RuntimeError(f"{name}: {exc} (waited for InService):\n{server.log_tail()}") from exc
    finally:
        if own:
            client.close()


def create_tiered_cluster(
    server: Server,
    name: str,
    *,
    nodes: int,
    percentage: int,
    deadline_s: float,
    instance_type: str = INSTANCE_TYPE,
) -> list[NodeAgent]:
    """A cluster of one group of ``nodes`` with tiered storage at ``percentage``, InService; each
    node's agent in the listing's order (RuntimeError unless every node has one endpoint and one
    agent process)."""
    with _client(server) as client:
        client.create_cluster(
            ClusterName=name,
            InstanceGroups=[
                {
                    "InstanceGroupName": "workers",
                    "InstanceType": instance_type,
                    "InstanceCount": nodes,
                    "ExecutionRole": EXECUTION_ROLE,
                    "LifeCycleConfig": LIFECYCLE,
                }
            ],
            Orchestrator=ORCHESTRATOR,
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": percentage},
        )
        wait_in_service(server, name, deadline_s, client)
        listing = client.list_nodes(name)
    endpoints = {
        n["InstanceId"]: n["AgentStatus"]["Endpoint"]
        for n in listing
        if (n.get("AgentStatus") or {}).get("Endpoint")
    }
    if len(endpoints) != nodes:
        raise RuntimeError(f"{name}: {len(endpoints)} agent endpoints listed, expected {nodes}")
    pids = {n: node_agent_pids(n) for n in endpoints}
    if any(len(p) != 1 for p in pids.values()):
        raise RuntimeError(f"{name}: agent processes per node: {pids}")
    return [NodeAgent(node_id=n, endpoint=e, pid=pids[n][0]) for n, e in endpoints.items()]


# ---------------------------------------------------------------------- timing


@dataclass
class Sample:
    seconds: float
    server_cpu_s: float | None
    client_cpu_s: float
    ended: float  # perf_counter() when the call returned


def timed(fn: Callable[[], T], server_pids: Sequence[int]) -> tuple[T, Sample]:
    """Run ``fn``; its result and wall time, the servers' CPU time (None if one is gone) and this
    process's CPU time."""
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


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all CPUs, /proc/stat: all but idle and
    iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Cpu:
    """CPU seconds of some processes from one moment on, and the rest of the machine's meanwhile
    (``others`` are this run's processes that are not measured one by one)."""

    pids: tuple[int, ...]
    others: tuple[int, ...] = ()
    before: list[float | None] = field(default_factory=list)
    machine_before: float = 0.0
    started: float = 0.0

    def start(self) -> Cpu:
        self.before = [cpu_seconds(p) for p in (*self.pids, *self.others)]
        self.machine_before = machine_busy_s()
        self.started = time.perf_counter()
        return self

    def spent(self) -> tuple[list[float | None], float]:
        """CPU seconds of each of ``pids``; CPUs the other processes of the machine kept busy on
        average (outside this run)."""
        wall = time.perf_counter() - self.started
        machine = machine_busy_s() - self.machine_before
        after = [cpu_seconds(p) for p in (*self.pids, *self.others)]
        spent = [None if b is None or a is None else a - b for b, a in zip(self.before, after, strict=True)]
        ours = sum(s for s in spent if s is not None)
        return spent[: len(self.pids)], max(machine - ours, 0.0) / wall


def median(values: Sequence[float]) -> float:
    """The median, NaN for none."""
    return statistics.median(values) if values else math.nan


def median_or_none(values: Iterable[float | None], digits: int | None = None) -> float | None:
    """The median of the values that are not None (rounded to ``digits`` when given), else None."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    found = statistics.median(present)
    return found if digits is None else round(found, digits)


# ---------------------------------------------------------------------- cells and the verdict


@dataclass(frozen=True)
class Target:
    """What a ratio must be: ``Target(">=", 2)`` prints as ``>= 2x`` (``spec`` formats the bound)."""

    op: str  # ">=", "<=" or "<"
    bound: float
    spec: str = "g"

    def met(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        if self.op == "<":
            return value < self.bound
        raise ValueError(f"unknown comparison {self.op!r}")

    def __str__(self) -> str:
        return f"{self.op} {format(self.bound, self.spec)}x"


@dataclass(frozen=True)
class Cell:
    """One ratio a script judges: what is compared (as the README's table names it), the measured
    value (None: could not be computed), its target, and whether it is met (by default: the value
    against the target; a script whose verdict is not the ratio's own passes ``met``)."""

    name: str
    value: float | None
    target: Target
    met_override: bool | None = None

    @property
    def met(self) -> bool:
        return self.target.met(self.value) if self.met_override is None else self.met_override

    @property
    def verdict(self) -> str:
        return "met" if self.met else "NOT MET"

    def judged(self, spec: str = ".2f") -> str:
        """``1.23x (target >= 2x) NOT MET``."""
        return f"{fmt(self.value, spec)}x (target {self.target}) {self.verdict}"

    def as_json(self) -> dict[str, Any]:
        """The script's JSON ``target_ratios`` entry (``bench.common.ratio_vs_target``)."""
        return ratio_vs_target(self.name, self.value, str(self.target), self.met)


def finish(report: str, cells: Sequence[Cell], json_path: Path | None, payload: Mapping[str, Any]) -> int:
    """Print the report; with ``json_path``, write ``payload`` there with the cells as its
    ``target_ratios``. Exit status 0: a benchmark measures, a target not met is no failure
    (``bench/run_all.py`` says which are)."""
    print(report)
    if json_path is not None:
        write_json(json_path, {**payload, "target_ratios": [c.as_json() for c in cells]})
    return 0
