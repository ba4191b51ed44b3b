"""One rank of a PyTorch DCP job that checkpoints through the amzn-sagemaker-checkpointing library.

Run by tests as a subprocess (one per rank, gloo backend on loopback). The library itself is used
unmodified: the only thing set is the default ``InMemoryClientConfig.base_url``, to this rank's
agent, which is what its writer and reader construct their client with.

    python -m tests.dcp_worker --rank R --world-size W --master-port P --agent-url URL
        --namespace NS --steps 1,2,3 [--load-step N] [--s3-base s3://b/p] [--save-to-s3]
        [--sdk-load] [--ray-layout] --out result.json

With ``--s3-base`` the reader is configured with that S3 base path (the library's own S3 fallback;
the endpoint comes from ``AWS_ENDPOINT_URL``). ``--save-to-s3``: the writer writes that S3 base
path itself too (``save_to_s3=True``). ``--sdk-load``: the load is hyperpod-sim's ``load_latest``
(its ``TieredCheckpointConfig`` with this agent and ``--s3-base``), not the library's reader, and
the result says whether every tensor is byte-identical. ``--ray-layout``: the library's
S3 layout under Ray Train (its ``RayS3PathStrategy``), given explicitly. ``--steps`` may be
empty: then the job only loads.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load
from torch.distributed.checkpoint.state_dict_saver import async_save

from tests.ranks import process_group, rank_parser, write_result


def point_library_at(url: str) -> None:
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig

    defaults = list(InMemoryClientConfig.__init__.__defaults__ or ())
    defaults[0] = url  # base_url is the first field
    InMemoryClientConfig.__init__.__defaults__ = tuple(defaults)


def model_state(step: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "weight": torch.randn(64, 32, generator=generator),
        "bias": torch.randn(64, generator=generator),
        "moment": torch.randn(128, generator=generator).to(torch.float64),
    }


def _same_bytes(got: torch.Tensor, wanted: torch.Tensor) -> bool:
    """The same dtype, shape and bytes."""
    return (
        got.dtype == wanted.dtype
        and got.shape == wanted.shape
        and got.contiguous().numpy().tobytes() == wanted.contiguous().numpy().tobytes()
    )


def main() -> int:
    parser = rank_parser()
    parser.add_argument("--steps", required=True)
    parser.add_argument("--load-step", type=int)
    parser.add_argument("--s3-base", default="")
    parser.add_argument("--expect-step", type=int, help="the step a load of the latest should find")
    parser.add_argument("--save-to-s3", action="store_true", help="the library writes --s3-base itself")
    parser.add_argument("--sdk-load", action="store_true", help="load with hyperpod-sim's load_latest")
    parser.add_argument("--ray-layout", action="store_true", help="the library's Ray Train S3 layout")
    args = parser.parse_args()

    point_library_at(args.agent_url)
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from amzn_sagemaker_checkpointing.config.s3_path_strategy import RayS3PathStrategy
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig

    def s3(base: str) -> dict[str, Any]:
        """The config members that name S3: the base path, or the Ray strategy over it."""
        if not base:
            return {}
        return (
            {"s3_path_strategy": RayS3PathStrategy(base)} if args.ray_layout else {"s3_tier_base_path": base}
        )

    result: dict[str, object] = {"rank": args.rank}
    with process_group(args):
        config = SageMakerCheckpointConfig(
            namespace=args.namespace,
            world_size=args.world_size,
            save_to_s3=args.save_to_s3,
            **s3(args.s3_base if args.save_to_s3 else ""),
        )
        read_config = SageMakerCheckpointConfig(
            namespace=args.namespace, world_size=args.world_size, **s3(args.s3_base)
        )
        steps = [int(s) for s in args.steps.split(",") if s]
        for step in steps:
            # Each rank saves its own tensors (distinct per rank): keys carry the rank.
            state = {f"rank{args.rank}": model_state(step, args.rank), "step": step}
            writer = SageMakerTieredStorageWriter(checkpoint_config=config, step=step)
            async_save(state_dict=state, storage_writer=writer).result()
            dist.barrier()

        expected_step = next(
            s for s in (args.load_step, args.expect_step, steps and steps[-1]) if s is not None
        )
        target = {
            f"rank{args.rank}": {k: torch.zeros_like(v) for k, v in model_state(0, 0).items()},
            "step": -1,
        }
        if args.sdk_load:
            from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, load_latest

            sdk_config = TieredCheckpointConfig(
                namespace=args.namespace,
                world_size=args.world_size,
                agent_url=args.agent_url,
                s3_tier_base_path=args.s3_base,
            )
            loaded = load_latest(target, sdk_config, step=args.load_step)
            result["served_by"] = {str(rank): tier for rank, tier in loaded.served_by.items()}
            result["sdk_step"] = loaded.step
        elif args.load_step is None:
            load(target, storage_reader=SageMakerTieredStorageReader(checkpoint_config=read_config))
        else:
            reader = SageMakerTieredStorageReader(checkpoint_config=read_config, step=args.load_step)
            load(target, storage_reader=reader)
        expected = model_state(expected_step, args.rank)
        result["loaded_step"] = target["step"]
        result["equal"] = all(_same_bytes(target[f"rank{args.rank}"][k], v) for k, v in expected.items())
        dist.barrier()
    write_result(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
