"""A training script as AWS documents the amzn-sagemaker-checkpointing library: its default client
config, nothing of hyperpod-sim's. On HyperPod the library calls the node's daemon at
``http://ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200``; here that name is the
node's own address inside its network namespace, so the script runs unchanged on a node of the
``namespaces`` node network (docs/nodes.md, "Namespaces"), as root::

    hyperpod-sim serve --node-network namespaces &
    # a cluster with tiered storage on, InService; then, for one of its nodes:
    hyperpod-sim node exec --cluster demo i-0123456789abcdef0 -- \\
        python examples/checkpoint_default_config.py --namespace demo-job --steps 3

It trains a small model from ``--first-step`` to ``--steps`` as a one-rank job (gloo on the node's loopback),
saves a checkpoint of every step to the in-memory tier with ``async_save``, loads the newest one
back and prints what it found as JSON: the step and whether every tensor came back byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)
from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
from torch.distributed.checkpoint import load
from torch.distributed.checkpoint.state_dict_saver import async_save


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True, help="the job's checkpoint namespace")
    parser.add_argument("--steps", type=int, default=3, help="the last step")
    parser.add_argument("--first-step", type=int, default=1, help="the first step (a job going on)")
    args = parser.parse_args()

    # torchrun sets these; a one-rank job started by hand gets them here.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group(
        backend="gloo",
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = SageMakerCheckpointConfig(namespace=args.namespace, world_size=dist.get_world_size())
        for step in range(args.first_step, args.steps + 1):
            loss = model(torch.randn(16, 32)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state = {"model": model.state_dict(), "step": step}
            writer = SageMakerTieredStorageWriter(checkpoint_config=config, step=step)
            async_save(state_dict=state, storage_writer=writer).result()

        saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        target = {"model": {name: torch.zeros_like(t) for name, t in saved.items()}, "step": -1}
        load(target, storage_reader=SageMakerTieredStorageReader(checkpoint_config=config))
        equal = all(torch.equal(target["model"][name], tensor) for name, tensor in saved.items())
        print(json.dumps({"loaded_step": target["step"], "equal": equal}))
        return 0 if equal and target["step"] == args.steps else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
