"""One rank of a small FSDP2 (``fully_shard``) training job on CPU (gloo) that checkpoints its model
and optimizer through hyperpod-sim's SDK, and may resume on another world size.

Run by tests as a subprocess, one per rank:

    python -m tests.fsdp_worker --rank R --world-size W --master-port P --agent-url URL
        --namespace NS [--resume | --from-full FILE] [--train N] [--save-step S]
        [--full-out FILE] --out result.json

``--resume``: the model and optimizer come from the newest checkpoint (``load_latest``),
whatever world size saved it. ``--from-full FILE``: from a whole (unsharded) state that rank 0 of
an earlier job wrote with ``--full-out`` (no checkpoint involved: the run a resume is compared
with). Then ``--train`` steps on a global batch that is a function of the step only, split across
the ranks; the result has each step's loss (averaged over the global batch). ``--save-step``:
after training, save the state as that step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageWriter, load_latest
from tests.ranks import process_group, rank_parser, write_result

GLOBAL_BATCH = 8  # divided evenly by 1, 2 and 4 ranks


def model_and_optimizer(world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(GLOBAL_BATCH, 12, generator=generator), torch.randn(
        GLOBAL_BATCH, 5, generator=generator
    )


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int, world: int
) -> float:
    inputs, targets = batch(step)
    part = GLOBAL_BATCH // world
    mine = slice(rank * part, (rank + 1) * part)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine])
    loss.backward()  # FSDP averages the gradients over the ranks: the global batch's mean
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return float(total.item())


def main() -> int:
    parser = rank_parser()
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--from-full")
    parser.add_argument("--train", type=int, default=0)
    parser.add_argument("--save-step", type=int)
    parser.add_argument("--full-out")
    args = parser.parse_args()

    result: dict[str, Any] = {"rank": args.rank}
    with process_group(args):
        model, optimizer = model_and_optimizer(args.world_size)
        config = TieredCheckpointConfig(
            namespace=args.namespace, world_size=args.world_size, agent_url=args.agent_url
        )
        first = 1
        if args.resume:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "step": 0}
            loaded = load_latest(state, config)
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
            result["loaded_step"] = loaded.step
            result["saved_world_size"] = loaded.saved_world_size
            first = int(state["step"]) + 1
        elif args.from_full:
            full = torch.load(args.from_full, weights_only=True)
            options = StateDictOptions(full_state_dict=True)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=full["model"],
                optim_state_dict=full["optimizer"],
                options=options,
            )
            first = int(full["step"]) + 1
        losses = [
            train_step(model, optimizer, step, args.rank, args.world_size)
            for step in range(first, first + args.train)
        ]
        result["losses"] = losses
        last = first + args.train - 1
        if args.save_step is not None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "step": last}
            save(state, storage_writer=TieredStorageWriter(config, step=args.save_step))
        if args.full_out:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = {
                "model": get_model_state_dict(model, options=options),
                "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
                "step": last,
            }
            if args.rank == 0:
                torch.save(full, args.full_out)
        dist.barrier()
    write_result(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
