"""Scale benchmark: one cluster of 8, 64, 256 and 1,024 nodes, each node a real agent process.

Usage::

    python bench/scale.py [--sizes 8,64,256,1024] [--idle-s 20] [--latest-calls 30]
        [--rollouts 3] [--json out.json]

``hyperpod-sim serve`` runs as a subprocess on a free loopback port with a fresh data dir
(SQLite), the ``local`` provisioner and its embedded S3 (SeaweedFS), with the settings a user
running 1,024 nodes sets (README, "A large cluster"): only the per-cluster instance limit is
raised. Heartbeat intervals, timeouts and everything else stay at their defaults.

For each size N, one size at a time, with nothing else of the run alive:

1. **create**: CreateCluster of one group of N nodes, tiered storage at 20 %; the time from just
   before the call until DescribeCluster says ``InService`` (N agents started and registered).
2. **memory**: the PSS (``/proc/<pid>/smaps_rollup``) summed over serve and every process below
   it (the node agents, their launcher, the embedded S3), after the cluster has been idle
   ``--settle-s`` seconds (30: the last agents' first heartbeats and reports are done).
3. **idle CPU**: the CPU time of that process tree over ``--idle-s`` seconds with nothing asked of
   it (heartbeats, timers, the reconciler), in cores.
4. **rollout**: UpdateCluster changing ``InstanceMemoryAllocationPercentage``, until the cluster is
   ``InService`` again (every node has acknowledged the new policy); the median of ``--rollouts``.
5. **latest**: one step saved through the library's protocol (a namespace of N + 1 ranks; each
   node's agent gets its rank's 4 KiB shard, node 0's the metadata rank's, 16 at a time; the
   time the whole step took is shown as ``save s``, not judged), then
   ``GET /v1/cp/checkpoints/{ns}/latest`` ``--latest-calls`` times in a row through the agent of
   the first listed node that is not one of the namespace's two homes (a home answers from its own
   memory: which nodes are homes depends on the random node ids, 2 of 8 or 2 of 1,024; with 2
   nodes both are, and node 0 asks): p50, p90 and the worst. Every answer must name the step.
   Measured twice: at once after the save (shown as ``at once ms``, not judged: the save's
   background work, replicas of async replication and reports to the namespace's homes, still runs
   on every node), and judged once the process tree's CPU over 2 s is back within 0.15 cores of its
   idle level (at most 120 s later): ``latest``'s own cost at this size.
6. DeleteCluster, until the cluster is gone and every agent process of it has exited.

Ratios judged, from one run: ``latest`` p50 at the largest size over the smallest (target <= 2x),
rollout at the largest size over the smallest (<= 20x), memory of everything at the largest size
over 8 GiB (<= 1x), idle CPU at the largest size over half a core (<= 1x), InService time at the
largest size over 20 minutes (<= 1x).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.client
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import (
    MIB,
    STAT_MINFLT,
    STAT_STATE,
    STAT_STIME,
    STAT_UTIME,
    Server,
    int_list_option,
    poll,
    proc_stat,
    progress,
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
)

DEFAULT_SIZES = (8, 64, 256, 1024)
FIRST_PERCENTAGE = 20
SHARD_BYTES = 4096
# `latest` is judged once the save's background work is done: the process tree's CPU over
# QUIET_WINDOW_S within QUIET_MARGIN_CORES of its idle level, waited for at most QUIET_MAX_S.
QUIET_WINDOW_S = 2.0
SAVE_ATTEMPTS = 3  # a rank's save answered 503 (a busy control plane) is made again, 1 s later
QUIET_MARGIN_CORES = 0.15
QUIET_MAX_S = 120.0
MEMORY_TARGET_BYTES = 8 * 1024 * MIB
IDLE_CPU_TARGET_CORES = 0.5
IN_SERVICE_TARGET_S = 20 * 60.0

# What a user running 1,024 nodes sets (README): the instance limit. Nothing else.
NAMESPACE = "scale-bench"
SETTINGS = {
    "HPSIM_PROVISIONING__MODE": "local",
    "HPSIM_LIMITS__MAX_INSTANCES_PER_CLUSTER": "1024",
}


# ---------------------------------------------------------------------- processes


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return children


def tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def pss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    ticks = {}
    for pid in pids:
        fields = proc_stat(pid)
        if fields is not None:
            ticks[pid] = int(fields[STAT_UTIME]) + int(fields[STAT_STIME])
    return ticks


def minor_faults(pids: list[int]) -> int:
    """Minor page faults of ``pids`` so far (a merged page written is copied at one)."""
    return sum(int(fields[STAT_MINFLT]) for fields in map(proc_stat, pids) if fields is not None)


def cpu_s(before: dict[int, int], after: dict[int, int], pids: list[int] | None = None) -> float:
    """CPU seconds that ``pids`` (None: every process of ``after``) used between two ``cpu_ticks``
    readings; a process missing from either reading counts nothing."""
    chosen = after if pids is None else pids
    ticks = sum(after[p] - before[p] for p in chosen if p in after and p in before)
    return ticks / os.sysconf("SC_CLK_TCK")


def agent_pids(data_dir: Path, node_ids: list[str]) -> list[int]:
    """The agent processes of ``node_ids``, from the pidfiles the provisioner writes."""
    from hyperpod_sim.infra.processes import Pidfile

    pids = []
    for node_id in node_ids:
        pidfile = Pidfile.read(data_dir / "agents" / node_id)
        if pidfile is None or not pidfile.alive():
            raise RuntimeError(f"node {node_id} has no running agent")
        pids.append(pidfile.pid)
    return pids


def alive(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[STAT_STATE] != "Z"


# ---------------------------------------------------------------------- same-page merging (KSM)

KSM = Path("/sys/kernel/mm/ksm")
# ksmd's rate: pages_to_scan per wake-up, a wake-up every sleep_millisecs. Measured here with 256
# merged agents, a scanned page costs ksmd 6-7 us: 300 pages every 20 ms took 8.5 % of a core,
# 1,000 every 200 ms 3.1 %. While the cluster's pages merge it scans fast (2,000 every 20 ms, about
# a quarter of a core: two full scans of 1,024 agents in about 6 minutes); then, for the idle
# measurement and after, 1,000 every 200 ms. README, "A large cluster", says the same.
KSM_FAST = {"pages_to_scan": "2000", "sleep_millisecs": "20"}
KSM_STEADY = {"pages_to_scan": "1000", "sleep_millisecs": "200"}
# Merging has settled once a whole full scan (one that began after the cluster was up) added
# fewer than MERGE_SETTLED of the pages merged: a page merges at the second scan that finds it alike.
MERGE_SETTLED = 0.02


def ksm_read(name: str) -> str | None:
    try:
        text = (KSM / name).read_text().strip()
    except OSError:
        return None
    if name == "advisor_mode":  # "[none] scan-time": the bracketed one is in force
        return next((w.strip("[]") for w in text.split() if w.startswith("[")), text)
    return text


class Ksm:
    """ksmd for the run, where this user may set it (root): on, at the fast rate while pages merge,
    at the steady rate after; the settings found are put back by ``restore``."""

    def __init__(self, wanted: bool) -> None:
        self.saved: dict[str, str] = {}
        self.wanted = wanted
        if not wanted:
            self.note = "ksm: off (--ksm off: the launcher does not mark the agents' pages mergeable)"
            return
        if ksm_read("run") is None:
            self.note = "ksm: this kernel has none (/sys/kernel/mm/ksm): agents' pages not merged"
            return
        try:
            # The kernel's own tuning (advisor_mode scan-time) was tried: at 32 nodes it scanned
            # 230,000 pages a second, 40 % of a core.
            self._set("advisor_mode", "none")
            self.rate(KSM_STEADY)
            self._set("run", "1")
        except OSError as exc:
            self.restore()
            self.note = f"ksm: cannot set ksmd ({exc}); as found: run={ksm_read('run')}"
            return
        self.note = (
            f"ksm: ksmd on, {KSM_FAST['pages_to_scan']} pages every {KSM_FAST['sleep_millisecs']} ms "
            f"while the cluster's pages merge (until a full scan adds under {MERGE_SETTLED:.0%}), then "
            f"{KSM_STEADY['pages_to_scan']} every {KSM_STEADY['sleep_millisecs']} ms"
        )

    def rate(self, settings: dict[str, str]) -> None:
        for name, value in settings.items():
            self._set(name, value)

    def _set(self, name: str, value: str) -> None:
        found = ksm_read(name)
        if found is None:
            return  # no advisor before Linux 6.7
        if name not in self.saved:
            self.saved[name] = found
        (KSM / name).write_text(value)

    @property
    def on(self) -> bool:
        """Whether the agents' pages are merged: marked mergeable, and ksmd runs."""
        return self.wanted and ksm_read("run") == "1"

    def restore(self) -> None:
        for name, value in reversed(list(self.saved.items())):
            try:
                (KSM / name).write_text(value)
            except OSError as exc:
                progress(f"ksm: could not put {name} back to {value}: {exc}")
        self.saved.clear()

    def full_scans(self) -> int:
        return int(ksm_read("full_scans") or 0)

    def settle(self, deadline_s: float) -> float:
        """At the fast rate, wait until merging has settled (``deadline_s`` at most: past it the
        run goes on, and says so), then back to the steady rate: the seconds waited."""
        if not self.on:
            return 0.0
        started = time.perf_counter()
        if self.saved:
            self.rate(KSM_FAST)
        # (full scans, pages sharing) at the end of each full scan seen; the first seen ends a scan
        # that may have begun before the cluster was up.
        ends: list[tuple[int, int]] = [(self.full_scans(), 0)]

        def settled() -> bool | None:
            scans, sharing = self.full_scans(), int(ksm_read("pages_sharing") or 0)
            if scans != ends[-1][0]:
                ends.append((scans, sharing))
            if len(ends) < 4:  # the first whole scan's end, and one more
                return None
            return True if ends[-1][1] - ends[-2][1] < MERGE_SETTLED * max(1, ends[-1][1]) else None

        try:
            poll(settled, deadline_s, 1.0, lambda: TimeoutError(f"merging not settled in {deadline_s} s"))
        except TimeoutError as exc:
            # A slow machine's ksmd may need longer (--merge-max-s): measured as merged so far.
            progress(f"ksm: {exc}; measuring with the pages merged so far")
        finally:
            if self.saved:
                self.rate(KSM_STEADY)
        return time.perf_counter() - started


def ksmd_pids() -> list[int]:
    """The kernel's ksmd thread, whose CPU the idle measurement counts with the process tree's."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "comm").read_text().strip() == "ksmd":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


# ---------------------------------------------------------------------- the agents' protocol


class Agent:
    """One keep-alive connection to an agent's library API."""

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=120)

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        self.conn.request(method, path, body=body, headers=headers or {})
        response = self.conn.getresponse()
        return response.status, response.read()

    def close(self) -> None:
        self.conn.close()


def shard_meta(data: bytes) -> str:
    import xxhash

    return json.dumps(
        {"checksum": base64.b64encode(xxhash.xxh3_128(data).digest()).decode(), "algorithm": "xxh3_128"}
    )


def save_step(endpoints: list[str], namespace: str, step: int) -> int:
    """One step of ``len(endpoints)`` ranks and the metadata rank, each rank through its node's
    agent; the saves answered 503 and made again."""
    ranks = len(endpoints)
    first = Agent(endpoints[0])
    try:
        status, body = first.call(
            "POST", f"/v1/cp/namespaces/{namespace}?num_ranks={ranks + 1}&steps_retained=1"
        )
        if status != 201:
            raise RuntimeError(f"namespace creation: {status} {body[:300]!r}")
    finally:
        first.close()

    def one(rank: int) -> int:
        """Save the rank, again after a 503 (as a trainer's library does, at most
        SAVE_ATTEMPTS times): the 503s answered."""
        data = os.urandom(SHARD_BYTES)
        for attempt in range(1, SAVE_ATTEMPTS + 1):
            agent = Agent(endpoints[rank % ranks])
            try:
                status, body = agent.call(
                    "POST",
                    f"/v1/cp/checkpoints/{namespace}/{rank}/{step}",
                    body=data,
                    headers={"Shard-Meta": shard_meta(data), "Content-Type": "application/octet-stream"},
                )
            finally:
                agent.close()
            if status == 200:
                return attempt - 1
            if status != 503 or attempt == SAVE_ATTEMPTS:
                break
            time.sleep(1.0)
        raise RuntimeError(f"rank {rank}: {status} {body[:300]!r}")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return sum(pool.map(one, range(ranks + 1)))


def latest_times(endpoint: str, namespace: str, step: int, calls: int) -> list[float]:
    agent = Agent(endpoint)
    times = []
    try:
        # The first answer may wait for replicas and reports to settle; it must name the step.
        def listed() -> bool | None:
            status, body = agent.call("GET", f"/v1/cp/checkpoints/{namespace}/latest?limit=1")
            return True if status == 200 and step in json.loads(body) else None

        poll(listed, 120.0, 0.2, lambda: TimeoutError(f"latest never listed step {step}"))
        for _ in range(calls):
            started = time.perf_counter()
            status, body = agent.call("GET", f"/v1/cp/checkpoints/{namespace}/latest?limit=1")
            times.append(time.perf_counter() - started)
            if status != 200 or json.loads(body) != [step]:
                raise RuntimeError(f"latest answered {status} {body[:300]!r}")
    finally:
        agent.close()
    return times


# ---------------------------------------------------------------------- one size


@dataclass
class Row:
    nodes: int
    create_s: float
    pss_total_mib: float
    pss_per_node_mib: float
    processes: int
    idle_cpu_cores: float
    idle_serve_cores: float
    idle_agents_cores: float
    idle_ksmd_cores: float  # the kernel's same-page merging thread, counted in idle_cpu_cores
    merge_s: float  # waited after settling for ksmd's merging to settle
    pss_merged_mib: float  # right after merging settled, before the steady wait (shown, not judged)
    rollout_s: float
    rollout_worst_s: float  # the slowest of the rollouts: the first after merging, as a rare one meets
    rollouts_s: list[float]
    rollout_cpu_serve_s: float  # CPU time of one rollout (the mean), serve's and all agents'
    rollout_cpu_agents_s: float
    rollout_faults_per_push: list[int]  # each rollout's minor faults an agent (copies of merged pages)
    save_s: float
    save_retries: int  # saves answered 503 and made again
    latest_at_once_p50_ms: float  # right after the save, its background work still running
    quiet_s: float  # from the save until the CPU was back near idle (the judged `latest` after it)
    latest_p50_ms: float
    latest_p90_ms: float
    latest_max_ms: float
    delete_s: float


def measure(server: Server, size: int, args: argparse.Namespace) -> Row:
    from hyperpod_sim.contracts.agent_api import namespace_homes
    from hyperpod_sim.sdk.client import HyperPodClient

    name = f"scale-{size}"
    data_dir = args.workdir / "hpsim-data"
    with HyperPodClient(server.endpoint, timeout_s=120) as client:
        started = time.perf_counter()
        client.create_cluster(
            ClusterName=name,
            InstanceGroups=[
                {
                    "InstanceGroupName": "workers",
                    "InstanceType": INSTANCE_TYPE,
                    "InstanceCount": size,
                    "ExecutionRole": EXECUTION_ROLE,
                    "LifeCycleConfig": LIFECYCLE,
                }
            ],
            Orchestrator=ORCHESTRATOR,
            TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": FIRST_PERCENTAGE},
        )
        client.wait_until_in_service(
            name, timeout=args.create_timeout_s, on_poll=lambda _: server.check_alive()
        )
        create_s = time.perf_counter() - started
        progress(f"  {size:>5} nodes: InService after {create_s:.1f} s")
        listed = client.list_nodes(name)
        endpoints = [n["AgentStatus"]["Endpoint"] for n in listed]
        if len(endpoints) != size or not all(endpoints):
            raise RuntimeError(f"{name}: {len(endpoints)} endpoints listed, expected {size}")
        node_ids = [n["InstanceId"] for n in listed]
        # `latest` through an agent that is not a home of the namespace, at every size: a home
        # answers from its own memory without a request, and which node is one depends on the
        # random node ids (2 of 8 nodes, 2 of 1,024).
        homes = set(namespace_homes(NAMESPACE, node_ids))
        asker = next((e for n, e in zip(node_ids, endpoints, strict=True) if n not in homes), endpoints[0])

        agents = agent_pids(data_dir, node_ids)
        time.sleep(args.settle_s)  # the starts' traffic settles before memory and idle CPU are read
        merge_s = args.ksm.settle(args.merge_max_s)
        processes = sorted(set(tree(server.proc.pid)) | set(agents))
        pss_merged = sum(p for p in (pss_bytes(pid) for pid in processes) if p is not None)
        if args.ksm.on:
            # At ksmd's steady rate, the agents' heartbeats and timers copy again what they touch:
            # memory is read after this and the idle window, not at the merge's best.
            time.sleep(args.steady_s)
        processes = sorted(set(tree(server.proc.pid)) | set(agents))
        ksmd = ksmd_pids() if args.ksm.on else []
        ticks_before = cpu_ticks(processes + ksmd)
        time.sleep(args.idle_s)  # the measurement: nothing asked of the cluster
        ticks_after = cpu_ticks(processes + ksmd)
        idle_cores = cpu_s(ticks_before, ticks_after) / args.idle_s
        ksmd_idle_cores = cpu_s(ticks_before, ticks_after, ksmd) / args.idle_s
        # Read after the idle window: with ksmd at its steady rate, what the agents' heartbeats
        # have copied again since their pages merged counts.
        pss = sum(p for p in (pss_bytes(pid) for pid in processes) if p is not None)
        serve_pid = server.proc.pid
        agents_idle_cores = cpu_s(ticks_before, ticks_after, agents) / args.idle_s
        serve_idle_cores = cpu_s(ticks_before, ticks_after, [serve_pid]) / args.idle_s
        progress(
            f"  {size:>5} nodes: {pss / MIB:.0f} MiB PSS in {len(processes)} processes "
            f"({pss_merged / MIB:.0f} MiB once merging settled after {merge_s:.0f} s), "
            f"idle {idle_cores:.2f} cores "
            f"(serve {serve_idle_cores:.2f}, agents {agents_idle_cores:.2f}, ksmd {ksmd_idle_cores:.2f})"
        )

        rollouts, faults = [], []
        rollout_before = cpu_ticks(processes)
        for i in range(args.rollouts):
            faults_before = minor_faults(agents)
            started = time.perf_counter()
            client.update_cluster(
                ClusterName=name,
                TieredStorageConfig={
                    "Mode": "Enable",
                    "InstanceMemoryAllocationPercentage": FIRST_PERCENTAGE + 10 * (i + 1),
                },
            )
            wait_status(client, name, "InService", args.create_timeout_s)
            rollouts.append(time.perf_counter() - started)
            faults.append(round((minor_faults(agents) - faults_before) / max(1, len(agents))))
        rollout_after = cpu_ticks(processes)
        rollout_serve_s = cpu_s(rollout_before, rollout_after, [serve_pid]) / max(1, args.rollouts)
        rollout_agents_s = cpu_s(rollout_before, rollout_after, agents) / max(1, args.rollouts)
        progress(
            f"  {size:>5} nodes: rollouts {[round(r, 2) for r in rollouts]} s; CPU of one: serve "
            f"{rollout_serve_s:.2f} s, agents {rollout_agents_s:.2f} s; minor faults a push {faults}"
        )

        started = time.perf_counter()
        retried = save_step(endpoints, NAMESPACE, 1)
        save_s = time.perf_counter() - started
        progress(
            f"  {size:>5} nodes: a step of {size + 1} ranks saved in {save_s:.1f} s ({retried} saves retried)"
        )
        # At once, while the save's background work (replicas of async replication, reports to the
        # namespace's homes) still runs on every node: shown, not judged. Then again once the
        # process tree's CPU is back near its idle level: `latest`'s own cost at this size.
        at_once = latest_times(asker, NAMESPACE, 1, args.latest_calls)
        quiet_s = quieten(processes, idle_cores + QUIET_MARGIN_CORES)
        latest = latest_times(asker, NAMESPACE, 1, args.latest_calls)
        ordered = sorted(latest)
        progress(
            f"  {size:>5} nodes: latest p50 {statistics.median(at_once) * 1000:.1f} ms right after the "
            f"save; {quiet_s:.0f} s later, quiet: p50 {statistics.median(latest) * 1000:.1f} ms, "
            f"worst {ordered[-1] * 1000:.1f} ms"
        )

        started = time.perf_counter()
        client.delete_cluster(name)
        client.wait_until_deleted(name, timeout=args.create_timeout_s)
        poll(
            lambda: None if any(alive(p) for p in agents) else True,
            300.0,
            0.2,
            lambda: TimeoutError(f"{name}: agent processes left after DeleteCluster"),
        )
        delete_s = time.perf_counter() - started
    return Row(
        nodes=size,
        create_s=round(create_s, 2),
        pss_total_mib=round(pss / MIB, 1),
        pss_per_node_mib=round(pss / MIB / size, 2),
        processes=len(processes),
        idle_cpu_cores=round(idle_cores, 3),
        idle_serve_cores=round(serve_idle_cores, 3),
        idle_agents_cores=round(agents_idle_cores, 3),
        idle_ksmd_cores=round(ksmd_idle_cores, 3),
        merge_s=round(merge_s, 1),
        pss_merged_mib=round(pss_merged / MIB, 1),
        rollout_s=round(statistics.median(rollouts), 3),
        rollout_worst_s=round(max(rollouts), 3),
        rollouts_s=[round(r, 3) for r in rollouts],
        rollout_cpu_serve_s=round(rollout_serve_s, 3),
        rollout_cpu_agents_s=round(rollout_agents_s, 3),
        rollout_faults_per_push=faults,
        save_s=round(save_s, 2),
        save_retries=retried,
        latest_at_once_p50_ms=round(statistics.median(at_once) * 1000, 2),
        quiet_s=round(quiet_s, 1),
        latest_p50_ms=round(statistics.median(latest) * 1000, 2),
        latest_p90_ms=round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
        latest_max_ms=round(ordered[-1] * 1000, 2),
        delete_s=round(delete_s, 2),
    )


def quieten(processes: list[int], cores: float) -> float:
    """Wait until ``processes`` use at most ``cores`` over a window (QUIET_MAX_S at most): the
    seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < QUIET_MAX_S:
        before = cpu_ticks(processes)
        time.sleep(QUIET_WINDOW_S)
        after = cpu_ticks(processes)
        used = cpu_s(before, after)
        if used / QUIET_WINDOW_S <= cores:
            break
    return time.perf_counter() - started


def wait_status(client: Any, name: str, want: str, deadline_s: float) -> None:
    """DescribeCluster every 20 ms until the cluster is ``want`` (a rollout's end, to the poll)."""

    def reached() -> bool | None:
        status = client.describe_cluster(name)["ClusterStatus"]
        if status == want:
            return True
        if status not in ("Creating", "Updating"):
            raise RuntimeError(f"{name} is {status} while waiting for {want}")
        return None

    poll(reached, deadline_s, 0.02, lambda: TimeoutError(f"{name} not {want} after {deadline_s} s"))


# ---------------------------------------------------------------------- report


def render(rows: list[Row], notes: list[str]) -> str:
    header = (
        f"{'nodes':>6} {'create s':>9} {'PSS MiB':>9} {'MiB/node':>9} {'procs':>6} {'idle cores':>10} "
        f"{'ksmd':>6} {'rollout s':>10} {'worst s':>8} {'save s':>7} {'at once ms':>10} "
        f"{'latest p50 ms':>14} {'p90 ms':>8} {'max ms':>8} {'delete s':>9}"
    )
    lines = [
        f"{r.nodes:>6} {r.create_s:>9.1f} {r.pss_total_mib:>9.0f} {r.pss_per_node_mib:>9.2f} "
        f"{r.processes:>6} {r.idle_cpu_cores:>10.3f} {r.idle_ksmd_cores:>6.3f} {r.rollout_s:>10.3f} "
        f"{r.rollout_worst_s:>8.3f} {r.save_s:>7.1f} {r.latest_at_once_p50_ms:>10.2f} "
        f"{r.latest_p50_ms:>14.2f} {r.latest_p90_ms:>8.2f} {r.latest_max_ms:>8.2f} {r.delete_s:>9.1f}"
        for r in rows
    ]
    return with_notes(table(header, lines), notes)


def cells(rows: list[Row]) -> list[Cell]:
    if not rows:
        return []
    small, large = rows[0], rows[-1]
    same = small is large
    return [
        Cell(
            f"latest p50, {large.nodes} / {small.nodes} nodes",
            None if same else large.latest_p50_ms / small.latest_p50_ms,
            Target("<=", 2.0),
        ),
        Cell(
            f"rollout, {large.nodes} / {small.nodes} nodes",
            None if same else large.rollout_s / small.rollout_s,
            Target("<=", 20.0),
        ),
        # The worst of the rollouts, each size's: with ksmd on, the first after merging, which is
        # every rollout of a cluster left idle for the minutes a full scan takes.
        Cell(
            f"rollout, worst of {len(large.rollouts_s)}, {large.nodes} / {small.nodes} nodes",
            None if same else large.rollout_worst_s / small.rollout_worst_s,
            Target("<=", 20.0),
        ),
        Cell(
            f"memory of everything at {large.nodes} nodes / 8 GiB",
            large.pss_total_mib * MIB / MEMORY_TARGET_BYTES,
            Target("<=", 1.0),
        ),
        Cell(
            f"idle CPU at {large.nodes} nodes / half a core",
            large.idle_cpu_cores / IDLE_CPU_TARGET_CORES,
            Target("<=", 1.0),
        ),
        Cell(
            f"CreateCluster to InService at {large.nodes} nodes / 20 min",
            large.create_s / IN_SERVICE_TARGET_S,
            Target("<=", 1.0),
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument(
        "--settle-s", type=float, default=30.0, help="after InService, before memory and idle CPU"
    )
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--latest-calls", type=int, default=30)
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--create-timeout-s", type=float, default=IN_SERVICE_TARGET_S * 1.5)
    parser.add_argument(
        "--ksm",
        choices=("auto", "off"),
        default="auto",
        help="auto: ksmd on for the run where this user may (root), as README's large cluster says; "
        "off: the agents' pages not marked mergeable",
    )
    parser.add_argument(
        "--merge-max-s", type=float, default=900.0, help="the longest wait for ksmd's full scans"
    )
    parser.add_argument(
        "--steady-s", type=float, default=60.0, help="after the merge, at ksmd's steady rate, before idle"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = int_list_option(parser, "--sizes", args.sizes, "nodes")
    rows: list[Row] = []
    args.ksm = Ksm(args.ksm == "auto")
    progress(args.ksm.note)
    settings = {**SETTINGS}
    if not args.ksm.on:
        settings["HPSIM_SIMULATION__MERGE_AGENT_PAGES"] = "false"
    try:
        with BenchRun("hpsim-scale-bench-", shm=True) as run:
            args.workdir = run.workdir
            server = run.serve({**settings, "HPSIM_SIMULATION__SHM_ROOT": str(run.shm_root)})
            run.ready(120.0, server)
            for size in sizes:
                progress(f"{size} nodes")
                rows.append(measure(server, size, args))
    finally:
        args.ksm.restore()
    notes = [
        "PSS: serve and every process below it (agents, their launcher, the embedded S3), "
        f"after {args.settle_s:g} s idle, with ksmd on its merging settled and "
        f"{args.steady_s:g} s at its steady rate, and the idle window.",
        args.ksm.note,
        f"idle cores: CPU time of those processes and of ksmd over {args.idle_s:g} s with nothing "
        "asked of them.",
        f"rollout: UpdateCluster to InService, median of {args.rollouts} (worst: the slowest of them); "
        "latest: through an agent that is "
        f"not a home, {args.latest_calls} calls after one saved step of N + 1 ranks.",
    ]
    found = cells(rows)
    report = render(rows, [*notes, *(f"{c.name}: {c.judged()}" for c in found)])
    return finish(report, found, args.json, {"sizes": sizes, "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    raise SystemExit(main())
