"""The trainer's checkpoint path, one state dict, every way of saving and loading it, in one run.

    .venv/bin/python bench/checkpoint_path.py [--sizes 256,1024] [--repeats 6] [--device cpu|cuda]
        [--json out.json]

For each size (MiB of tensors, in 16 tensors) it measures, in the same run on the same machine:

* **memcpy**: copying the state dict into preallocated tensors (the floor). On CUDA: the
  device-to-host copy into pinned host memory.
* **ours, fast path**: ``dcp.async_save`` with ``TieredStorageWriter`` (what training is blocked
  for, and the whole save), ``dcp.save`` (a blocking save) and ``dcp.load`` with
  ``TieredStorageReader``, through the node's agent's shared memory.
* **ours, HTTP**: the same writer and reader with the fast path off (shard bodies over HTTP).
* **DCP on /dev/shm**: PyTorch's ``FileSystemWriter`` / ``FileSystemReader`` on tmpfs.
* **the library**: ``amzn-sagemaker-checkpointing``'s writer and reader against our agent (CPU).

Saves repeat ``--repeats`` times into new steps; full saves and loads report the median of the
later half. The ``async_save`` stall is reported for every save: the first (the rank's first
buffer is allocated), the warm-up (saves 2 to retention + 1, which used to allocate fresh memory
each) and the warm ones, each as a ratio to a floor copy made just before it (copy bandwidth on a
shared machine drifts between phases of one run). The target is judged on the WORST save after the
first; the median of those is printed beside it. It starts ``hyperpod-sim serve`` (SQLite, a
one-node cluster with the default checkpoint policy, so the default in-memory retention of 3, and
a memory budget that holds the state a few times over) and stops it at the end. Ratios against
targets are printed last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import fmt, progress  # noqa: E402
from bench.runner import BenchRun, Cell, Target, create_tiered_cluster, finish  # noqa: E402

MIB = 1024 * 1024
TENSORS = 16
RETENTION = 3  # the default checkpoint policy's InMemoryRetention: saves 2..4 are the warm-up


def state_dict(size_mib: int, device: str) -> dict[str, Any]:
    import torch

    per = size_mib * MIB // TENSORS // 4
    generator = torch.Generator().manual_seed(size_mib)
    tensors = {f"layer{i}.weight": torch.randn(per, generator=generator) for i in range(TENSORS)}
    return {"model": {k: v.to(device) for k, v in tensors.items()}, "step": 0, "name": "bench"}


def median_tail(samples: list[float]) -> float:
    """The median of the later half: the first saves allocate the agent's buffers."""
    tail = samples[len(samples) // 2 :] or samples
    return statistics.median(tail)


def timed(fn: Callable[[], Any], *, sync: bool) -> float:
    import torch

    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, agent_url: str, size: int, workdir: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageReader, TieredStorageWriter

    cuda = args.device == "cuda"
    state = state_dict(size, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    row: dict[str, Any] = {"size_mib": size, "bytes": nbytes, "device": args.device}

    # The floor: a copy into preallocated (pinned, on CUDA) host tensors.
    floor = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state["model"].items()}

    def copy_all() -> None:
        for key, tensor in state["model"].items():
            floor[key].copy_(tensor, non_blocking=cuda)

    copy_all()
    row["memcpy_s"] = statistics.median([timed(copy_all, sync=cuda) for _ in range(args.repeats)])

    def ours(tag: str, fast: bool) -> None:
        config = TieredCheckpointConfig(
            namespace=f"bench-{tag}-{size}-{os.getpid()}", world_size=1, agent_url=agent_url, fast_path=fast
        )
        stalls, totals, saves, floors = [], [], [], []
        step = 0
        for _ in range(args.repeats):
            step += 1
            # The floor again, right before: this machine's copy bandwidth drifts by up to 1.8x
            # between phases of a run (a shared VM), so each stall is paired with its own floor.
            floors.append(timed(copy_all, sync=cuda))
            writer = TieredStorageWriter(config, step=step)
            started = time.perf_counter()
            future = async_save(state, storage_writer=writer)
            stalls.append(time.perf_counter() - started)
            future.result()
            totals.append(time.perf_counter() - started)
        for _ in range(args.repeats):
            step += 1
            saves.append(
                timed(
                    lambda s=step: save(state, storage_writer=TieredStorageWriter(config, step=s)), sync=cuda
                )
            )
        target = {
            "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "step": -1,
            "name": "",
        }
        loads = [
            timed(lambda: load(target, storage_reader=TieredStorageReader(config, step=step)), sync=cuda)
            for _ in range(args.repeats)
        ]
        if not all(torch.equal(target["model"][k], v) for k, v in state["model"].items()):
            raise RuntimeError(f"{tag}: the loaded state differs from the saved one")
        per_floor = [s / f for s, f in zip(stalls, floors, strict=True)]
        later = per_floor[1:] or per_floor
        row[f"{tag}_stall_s"] = statistics.median(stalls[1:] or stalls)
        row[f"{tag}_stalls_s"] = stalls
        row[f"{tag}_floors_s"] = floors
        row[f"{tag}_stall_per_floor_each"] = per_floor
        # Judged on the worst save after the first; the median of those beside it.
        row[f"{tag}_stall_per_floor"] = max(later)
        row[f"{tag}_stall_per_floor_median"] = statistics.median(later)
        row[f"{tag}_async_total_s"] = median_tail(totals)
        row[f"{tag}_save_s"] = median_tail(saves)
        row[f"{tag}_load_s"] = median_tail(loads)

    progress(f"{size} MiB: fast path")
    ours("fast", True)
    progress(f"{size} MiB: HTTP")
    ours("http", False)
    floor.clear()

    progress(f"{size} MiB: DCP on /dev/shm")
    row.update(measure_dcp_shm(state, args.repeats, cuda))

    if not cuda and not args.skip_library:
        progress(f"{size} MiB: amzn-sagemaker-checkpointing")
        row.update(measure_library(state, agent_url, size, args.repeats))
    return row


def measure_dcp_shm(state: dict[str, Any], repeats: int, cuda: bool) -> dict[str, Any]:
    """PyTorch's FileSystemWriter / FileSystemReader on /dev/shm: a new directory per save (the
    previous one removed), loads of the last; and DCP's default ``async_save`` with it (its own
    staging: a copy into fresh CPU memory, pinned on CUDA), each save's stall and whole save."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    shm = Path(tempfile.mkdtemp(prefix="hpsim-bench-dcp-", dir="/dev/shm"))
    try:
        stalls, totals = [], []
        for i in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            future = async_save(state, storage_writer=FileSystemWriter(str(shm / f"async_{i}")))
            stalls.append(time.perf_counter() - started)
            future.result()
            totals.append(time.perf_counter() - started)
            if i:
                shutil.rmtree(shm / f"async_{i - 1}", ignore_errors=True)
        shutil.rmtree(shm / f"async_{repeats - 1}", ignore_errors=True)
        saves = []
        for i in range(repeats):
            saves.append(
                timed(
                    lambda i=i: save(state, storage_writer=FileSystemWriter(str(shm / f"step_{i}"))),
                    sync=cuda,
                )
            )
            if i:
                shutil.rmtree(shm / f"step_{i - 1}", ignore_errors=True)
        last = shm / f"step_{repeats - 1}"
        target = {
            "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "step": -1,
            "name": "",
        }
        loads = [
            timed(lambda: load(target, storage_reader=FileSystemReader(str(last))), sync=cuda)
            for _ in range(repeats)
        ]
        return {
            "dcp_shm_save_s": median_tail(saves),
            "dcp_shm_load_s": median_tail(loads),
            "dcp_async_stalls_s": stalls,
            "dcp_async_stall_s": statistics.median(stalls[1:] or stalls),
            "dcp_async_worst_stall_s": max(stalls[1:] or stalls),
            "dcp_async_total_s": median_tail(totals),
        }
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def measure_library(state: dict[str, Any], agent_url: str, size: int, repeats: int) -> dict[str, float]:
    import logging

    import torch
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    logging.getLogger("sagemaker").setLevel(logging.ERROR)
    defaults = list(InMemoryClientConfig.__init__.__defaults__ or ())
    defaults[0] = agent_url
    InMemoryClientConfig.__init__.__defaults__ = tuple(defaults)
    config = SageMakerCheckpointConfig(namespace=f"bench-lib-{size}-{os.getpid()}", world_size=1)
    saves = [
        timed(
            lambda s=s: save(state, storage_writer=SageMakerTieredStorageWriter(config, step=s)), sync=False
        )
        for s in range(1, repeats + 1)
    ]
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": -1, "name": ""}
    loads = [
        timed(
            lambda: load(target, storage_reader=SageMakerTieredStorageReader(config, step=repeats)),
            sync=False,
        )
        for _ in range(repeats)
    ]
    return {"library_save_s": median_tail(saves), "library_load_s": median_tail(loads)}


def cells(row: dict[str, Any]) -> list[tuple[str, Cell]]:
    """What this script judges for one size: (what is compared, its cell)."""
    where = f"{row['size_mib']} MiB {row['device']}"
    stall_target = Target("<=", 2.0 if row["device"] == "cuda" else 1.5)
    what = "pinned D2H copy" if row["device"] == "cuda" else "memcpy"
    found = [
        (f"async_save stall / {what}, worst save after the first", row["fast_stall_per_floor"], stall_target),
        ("DCP /dev/shm save / ours (fast path)", row["dcp_shm_save_s"] / row["fast_save_s"], Target(">=", 2)),
        ("DCP /dev/shm load / ours (fast path)", row["dcp_shm_load_s"] / row["fast_load_s"], Target(">=", 2)),
    ]
    return [(what, Cell(f"{what}, {where}", value, target)) for what, value, target in found]


def _line(row: dict[str, Any], path: str, stall: float | None, save: float | None, load: float | None) -> str:
    rate = row["bytes"] / 1e9 / save if save else None
    return (
        f"{row['size_mib']:>6} {row['device']:6} {path:34} {fmt(stall, '9.4f')} {fmt(save, '9.4f')} "
        f"{fmt(load, '9.4f')} {fmt(rate, '10.2f')}"
    )


def phase(save: int) -> str:
    """Which part of a rank's rotation save ``save`` (1-based) is, with the default retention."""
    return "first" if save == 1 else "warm-up" if save <= RETENTION + 1 else "warm"


def render_stalls(rows: list[dict[str, Any]]) -> str:
    """Every async_save of the fast path and of HTTP: its floor, its stall and their ratio."""
    lines = ["", f"{'size':>6} {'path':5} {'save':>4} {'phase':8} {'floor s':>9} {'stall s':>9} {'ratio':>7}"]
    for row in rows:
        for tag in ("fast", "http"):
            stalls, floors = row[f"{tag}_stalls_s"], row[f"{tag}_floors_s"]
            for i, (stall, floor) in enumerate(zip(stalls, floors, strict=True)):
                lines.append(
                    f"{row['size_mib']:>6} {tag:5} {i + 1:>4} {phase(i + 1):8} {floor:9.4f} {stall:9.4f} "
                    f"{stall / floor:6.2f}x"
                )
            lines.append(
                f"{row['size_mib']:>6} {tag:5} after the first: worst {row[f'{tag}_stall_per_floor']:.2f}x, "
                f"median {row[f'{tag}_stall_per_floor_median']:.2f}x"
            )
    return "\n".join(lines)


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "",
        f"{'size':>6} {'device':6} {'path':34} {'stall s':>9} {'save s':>9} {'load s':>9} {'GB/s save':>10}",
    ]
    for row in rows:
        lines.append(_line(row, "memcpy into preallocated (floor)", None, row["memcpy_s"], None))
        lines.append(
            _line(row, "ours: fast path, async_save", row["fast_stall_s"], row["fast_async_total_s"], None)
        )
        lines.append(_line(row, "ours: fast path, save / load", None, row["fast_save_s"], row["fast_load_s"]))
        lines.append(
            _line(row, "ours: HTTP, async_save", row["http_stall_s"], row["http_async_total_s"], None)
        )
        lines.append(_line(row, "ours: HTTP, save / load", None, row["http_save_s"], row["http_load_s"]))
        lines.append(
            _line(row, "DCP FileSystemWriter on /dev/shm", None, row["dcp_shm_save_s"], row["dcp_shm_load_s"])
        )
        lines.append(
            _line(
                row,
                "DCP default async_save, /dev/shm",
                row["dcp_async_stall_s"],
                row["dcp_async_total_s"],
                None,
            )
        )
        if "library_save_s" in row:
            lines.append(
                _line(row, "amzn-sagemaker-checkpointing", None, row["library_save_s"], row["library_load_s"])
            )
    lines.append("")
    for row in rows:
        # Beside the target, no target of its own: what DCP's default async_save blocks for.
        worst_ours = max(row["fast_stalls_s"][1:] or row["fast_stalls_s"])
        worst_dcp = row["dcp_async_worst_stall_s"]
        lines.append(
            f"{row['size_mib']:>5} MiB {row['device']}: DCP default async_save stall, worst save after the "
            f"first: {worst_dcp:.4f} s, {worst_dcp / worst_ours:.2f}x ours ({worst_ours:.4f} s)"
        )
        for what, cell in cells(row):
            lines.append(f"{row['size_mib']:>5} MiB {row['device']}: {what}: {cell.judged()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,1024", help="MiB of tensors per state dict (comma-separated)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=6,
        help="saves per path: every async_save's stall is reported, full saves and loads as the "
        "median of the later half",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--skip-library", action="store_true", help="leave out amzn-sagemaker-checkpointing")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with BenchRun("hpsim-bench-ckpt-", shm=True, shm_prefix=f"hpsim-bench-ckpt-{os.getpid()}-") as run:
        os.environ["HPSIM_SIMULATION__SHM_ROOT"] = str(run.shm_root)  # the SDK here maps only under it
        # Budget: the instance's memory x 20 % x scale; hold the largest state ~8 times (the fast
        # path's rotation, retention 3 + 1, and the HTTP path's; older namespaces give way).
        scale = max(sizes) * MIB * 8 / (2048 * 1024**3 * 0.2)
        settings = {
            "HPSIM_PROVISIONING__MODE": "local",
            "HPSIM_SIMULATION__MEMORY_SCALE": f"{scale:.6f}",
            "HPSIM_SIMULATION__SHM_ROOT": str(run.shm_root),
            "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "120",
            "HPSIM_S3__EMBEDDED": "false",
        }
        server = run.serve(settings)
        run.ready(60, server)
        # The default checkpoint policy (in-memory retention 3): what a job gets.
        (agent,) = create_tiered_cluster(server, "bench", nodes=1, percentage=20, deadline_s=120)
        rows = [measure(args, agent.endpoint, size, run.workdir) for size in sizes]
        judged = [cell for row in rows for _, cell in cells(row)]
        return finish(render_stalls(rows) + "\n" + render(rows), judged, args.json, {"rows": rows})


if __name__ == "__main__":
    sys.exit(main())
