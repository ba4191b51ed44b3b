"""S3 tier benchmark: an agent persisting complete steps to S3, against plain boto3 uploads.

Usage::

    python bench/s3_tier.py [--s3 seaweedfs|moto] [--sizes 64,256] [--ranks 2] [--repeats 3] [--saves 20]
        [--json out.json]

One S3 endpoint for everything, in its own process so that it shares a GIL with no other side:
SeaweedFS by default (``--s3 seaweedfs``: ``weed mini`` as ``serve`` embeds it, through
``hyperpod_sim.serve.embedded_s3``, its data in the run's temp dir, its generated credentials enforced),
or moto's S3 server (``--s3 moto``: ``python -m moto.server`` on a loopback port, keeping objects
in memory: ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``, 1 GiB unless set: its default spills every part
over ~5 MiB to a temp file, and disk writeback made the times noisier). ``hyperpod-sim serve``
runs with ``HPSIM_S3__ENDPOINT_URL`` pointing at it (``HPSIM_S3__EMBEDDED=false``), the S3
server's credentials in its environment (its agents inherit them),
``HPSIM_SIMULATION__MEMORY_SCALE=1`` and shared memory under a temp dir in /dev/shm (removed at
the end), and one cluster of one ``ml.p5.48xlarge`` with tiered storage at 20 % (a ~410 GiB
budget: nothing is evicted for room). Its single agent has no replica peer, so nothing but the
S3 tier runs in its background.

1. **Persistence throughput.** Per size and repeat, the sides interleaved (each goes first in turn):

   * **boto3** (the baseline): this process uploads ``--ranks`` objects of the size with boto3's
     ``upload_fileobj`` and its defaults (``TransferConfig``: 8 MiB parts, 10 threads; client: 10
     pooled connections), one thread per object, all at once (the agent uploads its ranks in
     parallel too); timed from the first call to the last return.
   * **hyperpod-sim**: ``--ranks`` data ranks of the size and a 4 KiB metadata rank saved through
     the agent (the in-memory protocol, untimed), the cluster's checkpoint policy at
     ``PersistEverySteps: 1``: saving the metadata rank makes the step due. Timed from the metadata
     save's answer until the agent's ``hpsim_s3_persisted_steps_total`` counts the step, which it
     does as soon as its commit marker's PUT returned (the marker is visible from then on). The
     counter is polled every ``POLL_S`` over a keep-alive connection rather than HEAD on the
     marker: the S3 server limits every side here, and polling it would slow ours. The marker is then read
     and its shard list checked (untimed).
   * **S3Objects** (where the difference comes from): the agent's own upload code,
     ``agents.s3objects.S3Objects.upload`` (its boto3 client, its ``TransferConfig``, a HEAD check
     of each object), called in this process like the baseline, without the rest of the agent.

   MiB/s = ranks x size / median time; the target is hyperpod-sim / boto3. Every side's objects are
   deleted between repeats (ours by the policy's ``S3Retention: 1``, waited for) so that the S3 server's
   memory does not grow.

2. **Save latency while persisting.** Through the same agent, ``--saves`` steps of one data rank of
   ``--save-size`` MiB (each followed by an untimed metadata save, so that every step is complete)
   over one keep-alive ``http.client`` connection, the xxh3 checksums computed before any timing:

   * **off**: the cluster's policy names no S3 base URI: nothing is persisted;
   * **every step**: ``PersistEverySteps: 1``: every step is due, and the agent persists the newest
     due step in the background while the next saves arrive;
   * **off + S3 load** (the control, measured last, the policy off again): as *off*, while another
     process (this script's ``--s3-load`` mode) runs the agent's upload code (``S3Objects.upload``
     of an object of the save size) to S3 in a loop, paced to the MiB/s at which the agent
     persisted during *every step* (from its first timed save until nothing was pending): the same
     background work on this machine, outside the agent's process.
     If *every step* is much slower than the control, the agent's own process is in the way (its
     GIL, its event loop); if not, it is the machine's CPUs.

   Two untimed warm-up steps first in each (the first persist creates the agent's boto3 client),
   and the S3 tier idle before the timed saves. p50 / p90 of the data rank's save request; how many
   steps the agent persisted and how many bytes were uploaded in the background during the timed
   saves (persistence did overlap them).

CPU time of the S3 server, the agent and the uploading process per measurement comes from ``/proc`` (and
``/proc/stat`` for the whole machine: what other processes took meanwhile is printed too).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import MIB, Server, exit_on_sigterm, fmt, int_list_option, progress, table, with_notes
from bench.runner import (
    INSTANCE_TYPE,
    LOCAL_AGENTS,
    BenchRun,
    Cell,
    NodeAgent,
    Target,
    create_tiered_cluster,
    finish,
    wait_in_service,
)
from bench.s3_measure import (
    AGENT_CODE,
    BASELINE,
    CONTROL,
    METADATA,
    OFF,
    ON,
    OURS,
    POLL_S,
    WARMUP_STEPS,
    LatencyRow,
    ThroughputRow,
    measure_latency,
    measure_throughput,
)
from bench.s3_servers import (
    BUCKET,
    CREDENTIALS,
    S3Load,
    S3Server,
    agent_objects,
    moto_note,
    run_s3_load,
    s3_client,
    shm_file,
    start_s3,
)
from bench.tier_agent import Shard

PERCENTAGE = 20
CLUSTER = "bench-s3"
OURS_URI = f"s3://{BUCKET}/ours"
TARGET_THROUGHPUT = Target(">=", 0.9)
TARGET_LATENCY = Target("<=", 1.2)
POLICY_ON = {"S3BaseUri": OURS_URI, "PersistEverySteps": 1, "S3Retention": 1}
POLICY_OFF: dict[str, Any] = {}  # every member at its default: no S3 base URI
SCRIPT = str(Path(__file__).resolve())


# ---------------------------------------------------------------------- ours and the cluster


def start_ours(run: BenchRun, s3_endpoint: str) -> Server:
    settings = {
        **LOCAL_AGENTS,  # two cores saturated by uploads must not make the node look failed
        "HPSIM_SIMULATION__MEMORY_SCALE": "1",
        "HPSIM_SIMULATION__SHM_ROOT": str(run.shm_root),
        "HPSIM_S3__ENDPOINT_URL": s3_endpoint,
        "HPSIM_S3__EMBEDDED": "false",
    }
    return run.serve(settings)  # CREDENTIALS are in this process's environment by now


def create_cluster(server: Server, deadline_s: float) -> NodeAgent:
    """A 1-node tiered-storage cluster, InService, and its agent."""
    (agent,) = create_tiered_cluster(server, CLUSTER, nodes=1, percentage=PERCENTAGE, deadline_s=deadline_s)
    return agent


def put_policy(server: Server, policy: dict[str, Any], deadline_s: float) -> None:
    """Replace the cluster's checkpoint policy and wait until every agent applied it (InService)."""
    request = urllib.request.Request(
        f"{server.endpoint}/clusters/{CLUSTER}/checkpoint-policy",
        data=json.dumps(policy).encode(),
        headers={"Content-Type": "application/json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()
    wait_in_service(server, CLUSTER, deadline_s)


# ---------------------------------------------------------------------- cells and the report


@dataclass
class Ratio:
    size_mib: int
    ours_mib_s: float
    baseline_mib_s: float
    agent_code_mib_s: float
    ratio: float
    met: bool


def throughput_ratios(rows: list[ThroughputRow]) -> list[Ratio]:
    by = {(r.size_mib, r.side): r for r in rows}
    ratios = []
    for size in sorted({r.size_mib for r in rows}):
        ours, base, code = by[(size, OURS)], by[(size, BASELINE)], by[(size, AGENT_CODE)]
        ratio = ours.mib_s / base.mib_s
        ratios.append(
            Ratio(size, ours.mib_s, base.mib_s, code.mib_s, round(ratio, 3), TARGET_THROUGHPUT.met(ratio))
        )
    return ratios


def latency_ratio(latency: list[LatencyRow], persistence: str, attr: str) -> float | None:
    by = {x.persistence: x for x in latency}
    if OFF not in by or persistence not in by:
        return None
    return float(getattr(by[persistence], attr) / getattr(by[OFF], attr))


def cells_of(ratios: list[Ratio], latency: list[LatencyRow], args: argparse.Namespace) -> list[Cell]:
    """What this script judges: persistence throughput against boto3 per size, then (unless
    --no-latency) the save p50 while persisting every step against no S3 policy."""
    cells = [
        Cell(
            f"persistence throughput {q.size_mib} MiB/rank x {args.ranks}, {OURS} / {BASELINE}",
            q.ratio,
            TARGET_THROUGHPUT,
            q.met,
        )
        for q in ratios
    ]
    p50 = latency_ratio(latency, ON, "p50_s")
    if p50 is not None:
        what = f"save p50 {args.save_size} MiB, persisting every step / no S3 policy"
        cells.append(Cell(what, p50, TARGET_LATENCY))
    return cells


def render(
    rows: list[ThroughputRow],
    ratios: list[Ratio],
    latency: list[LatencyRow],
    cells: list[Cell],
    notes: list[str],
) -> str:
    header = (
        f"{'size MiB':>8} {'ranks':>5}  {'side':<13} {'median s':>8} {'min s':>7} {'MiB/s':>7} "
        f"{'S3 CPU s':>10} {'uploader CPU s':>14} {'other CPUs':>10}"
    )
    lines = table(header)
    for r in rows:
        lines.append(
            f"{r.size_mib:>8} {r.ranks:>5}  {r.side:<13} {r.median_s:>8.3f} {r.min_s:>7.3f} "
            f"{r.mib_s:>7.1f} {fmt(r.s3_cpu_s, '.2f'):>10} {fmt(r.uploader_cpu_s, '.2f'):>14} "
            f"{fmt(r.other_cpus, '.2f'):>10}"
        )
    lines.append("")
    for q, cell in zip(ratios, cells, strict=False):  # cells_of lists the throughput cells first
        lines.append(
            f"ratio {OURS}/{BASELINE} persistence throughput {q.size_mib} MiB/rank: {cell.judged()}; "
            f"{AGENT_CODE}/{BASELINE} {q.agent_code_mib_s / q.baseline_mib_s:.2f}x"
        )
    if latency:
        lines.append("")
        header = (
            f"{'persistence':<14} {'MiB':>4} {'saves':>5} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} "
            f"{'persisted':>9} {'bg MiB':>6} {'bg MiB/s':>8} {'drain s':>7} {'agent CPU s':>11} "
            f"{'S3 CPU s':>10} {'load CPU s':>10} {'other CPUs':>10} {'wall s':>6}"
        )
        lines += table(header)
        for x in latency:
            uploaded = None if x.uploaded_bytes is None else x.uploaded_bytes / MIB
            lines.append(
                f"{x.persistence:<14} {x.size_mib:>4} {x.saves:>5} {1000 * x.p50_s:>7.1f} "
                f"{1000 * x.p90_s:>7.1f} {1000 * x.max_s:>7.1f} {fmt(x.steps_persisted, 'd'):>9} "
                f"{fmt(uploaded, '.0f'):>6} {fmt(x.bg_mib_s, '.1f'):>8} {fmt(x.drain_s, '.2f'):>7} "
                f"{fmt(x.agent_cpu_s, '.2f'):>11} {fmt(x.s3_cpu_s, '.2f'):>10} "
                f"{fmt(x.load_cpu_s, '.2f'):>10} {x.other_cpus:>10.2f} {x.wall_s:>6.2f}"
            )
        p90 = latency_ratio(latency, ON, "p90_s")
        if len(cells) > len(ratios) and p90 is not None:
            lines.append(
                f"ratio save latency with/without persistence: p50 {cells[len(ratios)].judged()}; "
                f"p90 {p90:.2f}x"
            )
        c50, c90 = latency_ratio(latency, CONTROL, "p50_s"), latency_ratio(latency, CONTROL, "p90_s")
        if c50 is not None and c90 is not None:
            lines.append(
                f"control, the same upload rate from another process / off: p50 {c50:.2f}x, p90 {c90:.2f}x"
            )
        on = next((x for x in latency if x.persistence == ON), None)
        if on is not None:
            lines.append(
                "warm-up saves with persistence on (the second follows the agent's first persist): "
                + ", ".join(f"{1000 * s:.1f} ms" for s in on.warmup_s)
            )
    return with_notes(lines, notes)


def notes_of(args: argparse.Namespace, s3_server: S3Server) -> list[str]:
    """The notes printed under the tables (and kept in the JSON)."""
    from hyperpod_sim.agents.s3.objects import PART_BYTES, PART_THREADS

    return [
        f"throughput: {BASELINE} = this process's upload_fileobj with boto3's defaults (8 MiB parts, 10 "
        f"threads, 10 pooled connections) of {args.ranks} object(s) of the size at once, one thread "
        f"each; {AGENT_CODE} = the agent's upload code (agents/s3/objects.py: {PART_BYTES // MIB} MiB "
        f"parts, {PART_THREADS} threads, {4 * PART_THREADS} connections, then a HEAD check) the same "
        f"way; {OURS} = the agent persisting a step of {args.ranks} data rank(s) and a "
        f"{len(METADATA)}-byte metadata rank (xxh3 check of each shard, the uploads, the commit marker) "
        "from the metadata save's answer until its hpsim_s3_persisted_steps_total counted the step "
        f"(polled every {POLL_S * 1000:g} ms). MiB/s = ranks x size / median of {args.repeats}, the "
        "sides interleaved, each first in turn.",
        "S3 CPU s / uploader CPU s: CPU time of the S3 server's process and of the uploader (this "
        "process, or the agent) during one upload, median; S3 close to the wall time means the S3 "
        "server is the bottleneck. other CPUs: how many CPUs processes outside this run kept busy on "
        "average meanwhile (/proc/stat).",
        f"save latency: one data rank of {args.save_size} MiB per step through the agent (POST over a "
        "keep-alive http.client connection, checksum computed before), then an untimed metadata rank; "
        f"{OFF} = the policy names no S3 base URI; {ON} = PersistEverySteps 1; {CONTROL} (measured "
        f"last, the policy off again) = as {OFF}, while another process uploads {args.save_size} MiB "
        "objects to S3 with the agent's upload code, paced to the rate at which the agent persisted "
        f"in {ON} (what it uploaded from the first timed save until nothing was pending, per second; "
        f"pace_mib_s in the JSON). {WARMUP_STEPS} warm-up steps first, the S3 tier idle at the start; "
        "persisted = steps the agent committed during the timed saves; bg MiB = what the agent (or "
        "the load process) finished uploading meanwhile, bg MiB/s = that / wall s; drain s = last "
        "save -> nothing pending. p90 interpolates between the closest ranks.",
        f"{s3_server.version}{moto_note(s3_server.kind)}, {OURS} and this process share this "
        f"machine's {os.cpu_count()} "
        f"CPU(s); 1 x {INSTANCE_TYPE} at {PERCENTAGE} %, memory scale 1, SQLite, local provisioner, no "
        "replica peer.",
    ]


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256", help="MiB per rank, comma-separated (default 64,256)")
    parser.add_argument("--ranks", type=int, default=2, help="data ranks per step (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="uploads per size and side (default 3)")
    parser.add_argument("--saves", type=int, default=20, help="timed saves per latency run (default 20)")
    parser.add_argument("--save-size", type=int, default=64, help="MiB per latency save (default 64)")
    parser.add_argument("--no-latency", action="store_true", help="skip the save latency measurement")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for each server")
    parser.add_argument("--create-timeout", type=float, default=120.0, help="seconds for InService")
    parser.add_argument(
        "--s3",
        choices=("seaweedfs", "moto"),
        default="seaweedfs",
        help="the S3 server: SeaweedFS, what serve embeds by default (default), or moto",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--s3-load", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--s3-load-count", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--s3-load-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.s3_load is not None:
        return args
    args.sizes = [mib * MIB for mib in int_list_option(parser, "--sizes", args.sizes, " (MiB)")]
    if not args.sizes or args.sizes[0] < MIB or args.repeats < 1 or args.ranks < 1:
        parser.error("--sizes must list positive integers (MiB), --ranks and --repeats be >= 1")
    if args.saves < 2 or args.save_size < 1:
        parser.error("--saves must be >= 2 and --save-size >= 1")
    return args


def warm_up(s3: Any, objects: Any, body: bytes) -> None:
    """Each S3 client's first call, untimed."""
    warm = Shard.of(body[:MIB])
    s3.upload_fileobj(io.BytesIO(warm.body), BUCKET, "warm-up")
    with shm_file(warm.body) as opener, opener() as source:
        objects.upload("warm-up", source, size=MIB, checksum=warm.checksum, bucket=BUCKET)
    s3.delete_object(Bucket=BUCKET, Key="warm-up")


def measure_latencies(
    run: BenchRun,
    ours: Server,
    agent: NodeAgent,
    pids: tuple[int, ...],
    endpoint: str,
    body: bytes,
    args: Any,
) -> list[LatencyRow]:
    """Saves with the policy off, persisting every step, then the control (off, with the same upload
    rate from another process); the policy is off at the end."""
    latency = [measure_latency(agent, pids, OFF, body, args.saves, None)]
    progress(f"  saves without persistence: p50 {1000 * latency[-1].p50_s:.1f} ms")
    put_policy(ours, POLICY_ON, args.create_timeout)
    on = measure_latency(agent, pids, ON, body, args.saves, None)
    latency.append(on)
    progress(f"  saves while persisting: p50 {1000 * on.p50_s:.1f} ms")
    # The control offers the background upload rate the agent reached while persisting.
    rate = on.pace_mib_s or 0.0
    put_policy(ours, POLICY_OFF, args.create_timeout)
    load = S3Load(SCRIPT, run.workdir, endpoint, args.save_size, rate)
    run.add(load.server)
    try:
        latency.insert(1, measure_latency(agent, pids, CONTROL, body, args.saves, load))
    finally:
        load.server.stop()
    progress(
        f"  saves without persistence, S3 uploads from another process at {rate:.1f} MiB/s: "
        f"p50 {1000 * latency[1].p50_s:.1f} ms"
    )
    return latency


def json_payload(
    rows: list[ThroughputRow],
    ratios: list[Ratio],
    latency: list[LatencyRow],
    args: argparse.Namespace,
    s3_server: S3Server,
    notes: list[str],
) -> dict[str, Any]:
    """The JSON's members beside ``target_ratios``."""
    from hyperpod_sim.agents.s3.objects import PART_BYTES, PART_THREADS

    p50 = latency_ratio(latency, ON, "p50_s")
    return {
        "throughput": [asdict(r) for r in rows],
        "ratios": [asdict(q) for q in ratios],
        "latency": [asdict(x) for x in latency],
        "latency_ratios": {
            "p50": p50,
            "p90": latency_ratio(latency, ON, "p90_s"),
            "control_p50": latency_ratio(latency, CONTROL, "p50_s"),
            "control_p90": latency_ratio(latency, CONTROL, "p90_s"),
        },
        "targets": {"throughput": TARGET_THROUGHPUT.bound, "latency_p50": TARGET_LATENCY.bound},
        "targets_met": {
            "throughput": all(q.met for q in ratios),
            "latency_p50": None if p50 is None else TARGET_LATENCY.met(p50),
        },
        "config": {
            "sizes_mib": [s // MIB for s in args.sizes],
            "ranks": args.ranks,
            "repeats": args.repeats,
            "saves": args.saves,
            "save_size_mib": args.save_size,
            "instance_type": INSTANCE_TYPE,
            "percentage": PERCENTAGE,
            "policy": POLICY_ON,
            "part_bytes": PART_BYTES,
            "part_threads": PART_THREADS,
            "s3": s3_server.version,
            "cpu_count": os.cpu_count(),
        },
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.s3_load is not None:
        exit_on_sigterm()
        return run_s3_load(args.s3_load, args.save_size, args.s3_load_count, args.s3_load_rate)
    sizes: list[int] = args.sizes

    with BenchRun("hpsim-s3-bench-", shm=True, shm_prefix=f"hpsim-bench-{os.getpid()}-") as run:
        # Every S3 client here and in the children (serve and its agents, the load process) signs
        # with the S3 server's credentials: SeaweedFS's, which it enforces; for moto dummy ones (it
        # checks no signature, but botocore sends nothing unsigned).
        os.environ.update(CREDENTIALS)
        s3_server = start_s3(args.s3, run.workdir, args.startup_timeout)
        run.on_exit(s3_server.stop)
        os.environ.update(s3_server.credentials)
        ours = start_ours(run, s3_server.endpoint)
        run.ready(args.startup_timeout, ours)
        agent = create_cluster(ours, args.create_timeout)
        progress(f"  cluster InService: agent {agent.node_id} at {agent.endpoint} (pid {agent.pid})")
        pids = (s3_server.pid, agent.pid, ours.proc.pid, os.getpid())
        endpoint = s3_server.endpoint

        started = time.perf_counter()
        body = os.urandom(max(sizes[-1], args.save_size * MIB))
        progress(f"  payload generated in {time.perf_counter() - started:.1f} s")
        s3, objects = s3_client(endpoint), agent_objects(endpoint)
        warm_up(s3, objects, body)

        latency: list[LatencyRow] = []
        if not args.no_latency:
            latency = measure_latencies(run, ours, agent, pids, endpoint, body[: args.save_size * MIB], args)
        put_policy(ours, POLICY_ON, args.create_timeout)
        progress(f"  checkpoint policy {POLICY_ON} applied")
        rows = measure_throughput(agent, s3, objects, pids, sizes, args.ranks, args.repeats, body)
        ratios = throughput_ratios(rows)

        cells = cells_of(ratios, latency, args)
        notes = notes_of(args, s3_server)
        report = render(rows, ratios, latency, cells, notes)
        return finish(report, cells, args.json, json_payload(rows, ratios, latency, args, s3_server, notes))


if __name__ == "__main__":
    sys.exit(main())
