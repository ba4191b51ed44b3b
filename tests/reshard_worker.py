"""One rank of a job whose checkpoint state is sharded across its ranks (DTensor on a CPU device
mesh, gloo), saved and loaded through hyperpod-sim's SDK at whatever world size the job has: a
step saved by one world size loads resharded into another's sharding.

Run by tests as a subprocess, one per rank:

    python -m tests.reshard_worker --rank R --world-size W --master-port P --agent-url URL
        --namespace NS [--save N] [--load] [--load-step N] [--s3-base s3://b/p] --out result.json

The state is a function of the step only (never of the rank or the world size): tensors sharded
on dim 0 (rows that no world size here divides evenly) and on dim 1, a replicated DTensor, a
plain tensor every rank holds, and plain values. A load checks every rank's local shard exactly
against the same state laid out at this job's world size.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageWriter, load_latest
from tests.ranks import process_group, rank_parser, write_result


def full_state(step: int) -> dict[str, Any]:
    """The job's whole state at ``step``, unsharded."""
    generator = torch.Generator().manual_seed(step)
    return {
        "rows": torch.randn(37, 16, generator=generator),
        "cols": torch.randn(6, 29, generator=generator).to(torch.float64),
        "embedding": torch.randint(0, 1000, (13, 5), generator=generator, dtype=torch.int64),
        "norm": torch.randn(16, generator=generator),
        "plain": torch.randn(7, generator=generator),
        "step": step,
        "schedule": {"lr": 0.1 / (step + 1), "warmup": [1, 2, step]},
    }


PLACEMENTS = {"rows": [Shard(0)], "cols": [Shard(1)], "embedding": [Shard(0)], "norm": [Replicate()]}


def sharded(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``state`` laid out on ``mesh``: DTensors as ``PLACEMENTS`` says, the rest as it is."""
    return {
        key: distribute_tensor(value, mesh, PLACEMENTS[key]) if key in PLACEMENTS else value
        for key, value in state.items()
    }


def same(got: Any, wanted: Any) -> bool:
    """Exactly equal: for a DTensor, this rank's local shard and its placements."""
    if isinstance(wanted, DTensor):
        return (
            isinstance(got, DTensor)
            and got.placements == wanted.placements
            and same(got.to_local(), wanted.to_local())
        )
    if isinstance(wanted, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == wanted.dtype
            and got.shape == wanted.shape
            and torch.equal(got, wanted)
        )
    if isinstance(wanted, dict):
        return (
            isinstance(got, dict)
            and got.keys() == wanted.keys()
            and all(same(got[k], wanted[k]) for k in wanted)
        )
    return type(got) is type(wanted) and bool(got == wanted)


def main() -> int:
    parser = rank_parser()
    parser.add_argument("--save", type=int)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--load-step", type=int, help="load this step (default: the newest)")
    parser.add_argument("--s3-base", default="")
    args = parser.parse_args()

    result: dict[str, Any] = {"rank": args.rank}
    with process_group(args):
        mesh = init_device_mesh("cpu", (args.world_size,))
        config = TieredCheckpointConfig(
            namespace=args.namespace,
            world_size=args.world_size,
            agent_url=args.agent_url,
            s3_tier_base_path=args.s3_base,
        )
        if args.load or args.load_step is not None:
            template = sharded(full_state(987), mesh)  # this job's sharding, other values
            loaded = load_latest(template, config, step=args.load_step)
            result["loaded_step"] = loaded.step
            result["saved_world_size"] = loaded.saved_world_size
            result["served_by"] = {str(k): v for k, v in loaded.served_by.items()}
            result["equal"] = same(template, sharded(full_state(loaded.step), mesh))
        if args.save is not None:
            save(
                sharded(full_state(args.save), mesh),
                storage_writer=TieredStorageWriter(config, step=args.save),
            )
            result["saved"] = args.save
        torch.distributed.barrier()
    write_result(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
