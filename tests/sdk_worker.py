"""One rank of a training job that checkpoints with hyperpod-sim's SDK (``hyperpod_sim/sdk/checkpoint.py``).

Run by tests as a subprocess, one per rank, gloo on loopback:

    python -m tests.sdk_worker --rank R --world-size W --master-port P --agent-url URL
        --namespace NS [--save 1,2,3] [--async] [--http] [--crash-before-commit N]
        [--crash-in-finish N] [--run R] [--load] --out result.json

Each rank's state is a small model, its Adam optimizer state after a few updates, and plain
values; it is a function of (step, rank, run), so a loaded state is checked exactly, and a
step saved again by a later run (``--run``) holds other values than the earlier run's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageWriter, load_latest
from tests.ranks import process_group, rank_parser, write_result


def training_state(step: int, rank: int, run: int = 1) -> dict[str, Any]:
    torch.manual_seed(1000 * step + rank + 1_000_000 * (run - 1))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        optimizer.step()
    return {
        f"rank{rank}": {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "extra": {
                "step": step,
                "name": f"run-{rank}",
                "losses": [0.5, 0.25 * step],
                "half": torch.ones(3, dtype=torch.float16) * step,
            },
        }
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main() -> int:
    parser = rank_parser()
    parser.add_argument("--save", default="")
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--http", action="store_true", help="no fast path")
    parser.add_argument("--crash-before-commit", type=int, help="stage this step, then exit hard")
    parser.add_argument(
        "--crash-in-finish", type=int, help="save this step; the coordinator exits hard before its metadata"
    )
    parser.add_argument("--run", type=int, default=1, help="which run's values the saves hold")
    parser.add_argument("--load", action="store_true")
    args = parser.parse_args()

    result: dict[str, Any] = {"rank": args.rank, "saved": []}
    with process_group(args):
        config = TieredCheckpointConfig(
            namespace=args.namespace,
            world_size=args.world_size,
            agent_url=args.agent_url,
            fast_path=not args.http,
        )
        for step in [int(s) for s in args.save.split(",") if s]:
            writer = TieredStorageWriter(config, step=step)
            state = training_state(step, args.rank, args.run)
            if args.use_async:
                async_save(state, storage_writer=writer).result()
            else:
                save(state, storage_writer=writer)
            result["saved"].append(step)
            result["stage_seconds"] = writer.stage_seconds
        if args.crash_before_commit is not None:
            writer = TieredStorageWriter(config, step=args.crash_before_commit)
            writer.stage(training_state(args.crash_before_commit, args.rank))
            write_result(args, {"rank": args.rank, "staged": True})
            os._exit(0)  # dies with the step staged in shared memory, never committed
        if args.crash_in_finish is not None:
            write_result(args, {"rank": args.rank, "died_in_finish": args.crash_in_finish})

            class DiesInFinish(TieredStorageWriter):
                def finish(self, *_: Any) -> None:
                    os._exit(0)  # every shard is committed, the metadata never written

            try:
                step = args.crash_in_finish
                state = training_state(step, args.rank, args.run)
                save(state, storage_writer=DiesInFinish(config, step=step))
            finally:
                os._exit(0)  # the other ranks lose the coordinator and die too
        if args.load:
            template = training_state(987, args.rank)  # same structure, other values
            loaded = load_latest(template, config)
            result["loaded_step"] = loaded.step
            result["fast_path"] = config.client().fast_path
            result["served_by"] = {str(k): v for k, v in loaded.served_by.items()}
            result["equal"] = same(template, training_state(loaded.step, args.rank))
            runs = [run for run in (1, 2, 3) if same(template, training_state(loaded.step, args.rank, run))]
            result["loaded_run"] = runs[0] if runs else None
            result["skipped"] = {str(k): v for k, v in loaded.skipped.items()}
            result["rejected"] = {str(k): v for k, v in loaded.rejected.items()}
        dist.barrier()
    write_result(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
