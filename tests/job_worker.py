"""One rank of a job that ``hyperpod-sim job run`` starts (tests/test_jobs.py): everything it knows
comes from the environment the supervisor gives it (torchrun's variables and the node's).

    python -m tests.job_worker allreduce
    python -m tests.job_worker train --namespace NS --steps N --progress FILE [--pause-at K]

``allreduce``: sums RANK + 1 over the job (gloo, across nodes) and prints what it got and where it
ran (its node, network namespace and address). ``train``: resumes from the newest complete step
of NS (the SDK's ``load_latest``), then saves steps up to N, one DCP save per step through the
node's agent; rank 0 appends ``attempt step`` to FILE after each save. With ``--pause-at K``
the first attempt waits after step K for as long as the test needs (its node is lost meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import save

from hyperpod_sim.sdk.checkpoint import (
    CheckpointNotFound,
    TieredCheckpointConfig,
    TieredStorageWriter,
    load_latest,
)


def source_address(peer: str) -> str:
    """The address this process's packets to ``peer`` leave from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        address: str = probe.getsockname()[0]
        return address


def state_at(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {f"rank{rank}": torch.full((256,), float(step * 1000 + rank))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["allreduce", "train"])
    parser.add_argument("--namespace")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--progress")
    parser.add_argument("--pause-at", type=int)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["HPSIM_JOB_ATTEMPT"])
    dist.init_process_group(backend="gloo", init_method="env://", rank=rank, world_size=world)
    try:
        if args.mode == "allreduce":
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            print(
                json.dumps(
                    {
                        "rank": rank,
                        "sum": total.item(),
                        "node": os.environ["HPSIM_NODE_ID"],
                        "group_rank": int(os.environ["GROUP_RANK"]),
                        "local_rank": int(os.environ["LOCAL_RANK"]),
                        "master": os.environ["MASTER_ADDR"],
                        # Where it ran: its network namespace, and its address towards rank 0's.
                        "netns": os.readlink("/proc/self/ns/net"),
                        "source": source_address(os.environ["MASTER_ADDR"]),
                    }
                ),
                flush=True,
            )
            return 0
        config = TieredCheckpointConfig(namespace=args.namespace, world_size=world)
        state = state_at(0, rank)
        try:
            loaded = load_latest(state, config)
            start = loaded.step
            assert torch.equal(state[f"rank{rank}"], state_at(start, rank)[f"rank{rank}"]), (
                "loaded other values"
            )
        except CheckpointNotFound:
            start = 0
        where = os.readlink("/proc/self/ns/net")
        print(f"attempt {attempt} resumes after step {start} (network namespace {where})", flush=True)
        for step in range(start + 1, args.steps + 1):
            save(state_at(step, rank), storage_writer=TieredStorageWriter(config, step=step))
            dist.barrier()
            if rank == 0:
                with open(args.progress, "a") as progress:
                    progress.write(f"{attempt} {step}\n")
            if args.pause_at is not None and attempt == 1 and step == args.pause_at:
                gate = Path(args.progress + ".hold")
                deadline = time.monotonic() + 300
                while gate.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)  # until the test lets it go, or its node is lost
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
