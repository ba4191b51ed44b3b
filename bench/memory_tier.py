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
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import MIB, Server, fmt, http_json, int_list_option, progress, table, with_notes
from bench.memory_measure import (
    OURS,
    POLL_S,
    RAW,
    REFERENCE,
    TARGET_RSS_FACTOR,
    Agent,
    MemoryRow,
    ReplicationRow,
    Row,
    measure_main,
    measure_replication,
    mib,
)
from bench.memory_servers import (
    measure_ceiling,
    run_ceiling_receiver,
    run_raw_http_server,
    run_reference_server,
)
from bench.runner import LOCAL_AGENTS, BenchRun, Cell, Target, create_tiered_cluster, finish, median
from bench.tier_agent import AgentConnection

INSTANCE_TYPE = "ml.p5.48xlarge"
PERCENTAGE = 20
NODES = 2
TARGET_SAVE = Target(">=", 1.5)
TARGET_LOAD = Target(">=", 2.0)
TARGET_RSS = Target("<=", TARGET_RSS_FACTOR)
SCRIPT = str(Path(__file__).resolve())


# ---------------------------------------------------------------------- servers and the cluster


def start_ours(run: BenchRun, replication: str) -> Server:
    """``hyperpod-sim serve`` whose agents keep shards under ``run.shm_root/replication`` and
    replicate ``replication`` (async or sync)."""
    assert run.shm_root is not None
    settings = {
        **LOCAL_AGENTS,  # two cores saturated by 512 MiB transfers must not make a node look failed
        "HPSIM_SIMULATION__MEMORY_SCALE": "1",
        "HPSIM_SIMULATION__SHM_ROOT": str(run.shm_root / replication),
        "HPSIM_AGENT_REPLICATION": replication,
    }
    return run.serve(settings, subdir=replication, name=f"{OURS} ({replication})")


def create_cluster(server: Server, name: str, deadline_s: float) -> Agent:
    """A 2-node tiered-storage cluster, InService; its first node's agent and that agent's peer."""
    agents = create_tiered_cluster(
        server, name, nodes=NODES, percentage=PERCENTAGE, deadline_s=deadline_s, instance_type=INSTANCE_TYPE
    )
    by_id = {a.node_id: a for a in agents}
    first = agents[0]
    policy = http_json(f"{first.endpoint}/v1/policy")
    peers = [p["node_id"] for p in (policy.get("replication") or {}).get("peers", [])]
    if len(peers) != 1 or peers[0] not in by_id:
        raise RuntimeError(f"{name}: {first.node_id} has replica peers {peers}, expected the other node")
    peer = by_id[peers[0]]
    return Agent(first.node_id, first.endpoint, first.pid, peer.node_id, peer.endpoint, peer.pid)


# ---------------------------------------------------------------------- cells and the report


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
                save_met=TARGET_SAVE.met(save_ratio),
                load_met=TARGET_LOAD.met(load_ratio),
                save_bound=None if raw is None else round(ref.save_min_s / raw.save_min_s, 3),
                load_bound=None if raw is None else round(ref.load_min_s / raw.load_min_s, 3),
                load_client_share=round(ours.load_client_cpu_s / ours.load_median_s, 3),
            )
        )
    return found


def cells_of(ratios: list[Ratio], memory: list[MemoryRow]) -> list[Cell]:
    """What this script judges: save and load speed against the reference per size, and the saving
    agent's RSS growth per byte held."""
    cells: list[Cell] = []
    for q in ratios:
        what = f"{q.size_mib} MiB (library's %s), {OURS} / {REFERENCE}"
        cells.append(Cell(f"save speed {what % 'put_checkpoint'}", q.save, TARGET_SAVE, q.save_met))
        cells.append(Cell(f"load speed {what % 'get_checkpoint'}", q.load, TARGET_LOAD, q.load_met))
    for m in memory:
        what = f"agent RSS growth / bytes held, {m.size_mib} MiB shards"
        cells.append(Cell(what, m.rss_growth_over_held, TARGET_RSS, m.target_met))
    return cells


def render(
    rows: list[Row],
    ratios: list[Ratio],
    cells: list[Cell],
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
    for i, q in enumerate(ratios):
        save, load = cells[2 * i], cells[2 * i + 1]  # as cells_of lists them
        lines.append(f"ratio {OURS}/{REFERENCE} {q.size_mib} MiB: save {save.judged()}; load {load.judged()}")
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
    lines += render_replication(replication)
    lines += render_memory(memory)
    return with_notes(lines, notes)


def render_replication(replication: list[ReplicationRow]) -> list[str]:
    """The async / sync table and the save-time ratios (nothing without the replication run)."""
    if not replication:
        return []
    lines = [""]
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
    return lines


def render_memory(memory: list[MemoryRow]) -> list[str]:
    """The saving agent's memory table and its verdict."""
    if not memory:
        return []
    lines = [""]
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
    return lines


def notes_of(repeats: int) -> list[str]:
    """The notes printed under the tables (and kept in the JSON)."""
    return [
        "save = the library's put_checkpoint (xxh3-128 of the bytes in the client, then one POST "
        "through requests); load = get_checkpoint (requests reads the body in 10 KiB pieces and "
        "joins them; the client then hashes it and compares the checksum). Both are the library's own "
        "cost, paid the same way against both servers: lib CPU s is this process's CPU time per "
        "operation, srv CPU s the server processes' (ours: the saving agent and its peer).",
        f"one rank, new step per save (1..{repeats}), the servers interleaved (each goes first in "
        f"turn), medians over {repeats}; MiB/s = size / median time. After "
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
        f"then {repeats} timed, median.",
    ]


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    helper_mode = (args.reference_server, args.ceiling_receiver, args.raw_server) != (None, None, None)
    if not helper_mode:
        args.sizes = [mib * MIB for mib in int_list_option(parser, "--sizes", args.sizes, " (MiB)")]
        if not args.sizes or args.sizes[0] < MIB or args.repeats < 1:
            parser.error("--sizes must list positive integers (MiB) and --repeats be >= 1")
    return args


def json_payload(
    rows: list[Row],
    ratios: list[Ratio],
    ceiling: dict[int, list[float]],
    replication: list[ReplicationRow],
    memory: list[MemoryRow],
    args: argparse.Namespace,
    notes: list[str],
) -> dict[str, Any]:
    """The JSON's members beside ``target_ratios``."""
    return {
        "rows": [asdict(r) for r in rows],
        "ratios": [asdict(q) for q in ratios],
        "targets": {"save": TARGET_SAVE.bound, "load": TARGET_LOAD.bound, "rss_factor": TARGET_RSS.bound},
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
            "sizes_mib": [s // MIB for s in args.sizes],
            "repeats": args.repeats,
            "instance_type": INSTANCE_TYPE,
            "nodes": NODES,
            "percentage": PERCENTAGE,
            "cpu_count": os.cpu_count(),
        },
        "notes": notes,
    }


def ceiling_of(run: BenchRun, payloads: dict[int, bytes], args: argparse.Namespace) -> dict[int, list[float]]:
    """The loopback ceiling: the receiver started, the rounds measured, the receiver stopped."""
    receiver = run.helper("ceiling", SCRIPT, "--ceiling-bytes", str(args.sizes[-1]), "--ceiling-receiver")
    run.ready(args.startup_timeout, receiver, path=None)
    ceiling = measure_ceiling(receiver.port, payloads, args.repeats)
    receiver.stop()
    progress(
        "  ceiling: "
        + ", ".join(f"{s // MIB} MiB {s / MIB / median(r):.0f} MiB/s" for s, r in ceiling.items())
    )
    return ceiling


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reference_server is not None:
        return run_reference_server(args.reference_server)
    if args.ceiling_receiver is not None:
        return run_ceiling_receiver(args.ceiling_receiver, args.ceiling_bytes)
    if args.raw_server is not None:
        return run_raw_http_server(args.raw_server, args.raw_bytes)
    sizes: list[int] = args.sizes

    with BenchRun("hpsim-tier-bench-", shm=True) as run:
        assert run.shm_root is not None
        ours = start_ours(run, "async")
        reference = run.helper(REFERENCE, SCRIPT, "--reference-server")
        run.ready(args.startup_timeout, ours, reference)
        agent = create_cluster(ours, "bench-tier", args.create_timeout)
        budget = AgentConnection(agent.endpoint, 30)
        progress(
            f"  cluster InService: saving agent {agent.node_id} at {agent.endpoint} (pid {agent.pid}), "
            f"replica peer {agent.peer_id}; budget {budget.value('hpsim_tier_budget_bytes') / 2**30:.1f} GiB"
        )
        budget.close()

        started = time.perf_counter()
        largest = os.urandom(sizes[-1])
        payloads = {size: largest if size == len(largest) else largest[:size] for size in sizes}
        progress(f"  {len(payloads)} payload(s) generated in {time.perf_counter() - started:.1f} s")
        ceiling = ceiling_of(run, payloads, args)

        raw = run.helper(RAW.replace(" ", "-"), SCRIPT, "--raw-bytes", str(sizes[-1]), "--raw-server")
        run.ready(args.startup_timeout, raw, path=None)
        rows, memory = measure_main(
            agent, run.shm_root / "async", reference, raw, payloads, args.repeats, progress
        )
        ratios = ratios_of(rows)
        reference.stop()
        raw.stop()

        replication: list[ReplicationRow] = []
        if not args.no_replication:
            sync_server = start_ours(run, "sync")
            run.ready(args.startup_timeout, sync_server)
            sync_agent = create_cluster(sync_server, "bench-tier-sync", args.create_timeout)
            replication = measure_replication(
                {"async": agent, "sync": sync_agent}, payloads, args.repeats, progress
            )

        cells = cells_of(ratios, memory)
        notes = notes_of(args.repeats)
        report = render(rows, ratios, cells, ceiling, replication, memory, notes)
        return finish(
            report, cells, args.json, json_payload(rows, ratios, ceiling, replication, memory, args, notes)
        )


if __name__ == "__main__":
    sys.exit(main())
