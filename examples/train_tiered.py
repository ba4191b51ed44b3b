"""Train a small model with 2 to 4 ranks and tiered checkpoints, against a hyperpod-sim cluster.

With the control plane running (``make run``), in another terminal::

    .venv/bin/python examples/train_tiered.py --ranks 2 --steps 40

It creates (or reuses) a tiered-storage cluster with one node per rank, sets its checkpoint policy
(S3 every ``--s3-every`` steps, in the embedded S3 by default) and runs itself as a job on the
cluster's nodes with ``hyperpod-sim job run --auto-resume`` (docs/jobs.md): one process per rank,
on its node, talking to its node's agent, gloo between the nodes. Each rank trains and
checkpoints to memory every ``--save-every`` steps with ``dcp.async_save`` (training goes on
while it commits, is replicated and, on due steps, persisted to S3). When a rank fails
(``--fail-at``) or its node is lost, the job restarts by itself and every rank resumes from the
newest complete checkpoint, wherever it is held; so does a run started again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROLE = "arn:aws:iam::123456789012:role/hpsim-example"
EKS = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/hpsim-example"}}


def ensure_cluster(args: argparse.Namespace) -> list[str]:
    """The cluster's agent endpoints, one per rank's node, creating the cluster if needed."""
    from hyperpod_sim.sdk.client import ClusterError, HyperPodClient

    with HyperPodClient(args.endpoint_url) as client:
        try:
            status = client.describe_cluster(args.cluster)["ClusterStatus"]
        except Exception:
            status = None
        if status is None:
            print(f"creating cluster {args.cluster} ({args.nodes} nodes, tiered storage on)", flush=True)
            client.create_cluster(
                ClusterName=args.cluster,
                InstanceGroups=[
                    {
                        "InstanceGroupName": "workers",
                        "InstanceType": "ml.g5.2xlarge",
                        "InstanceCount": args.nodes,
                        "ExecutionRole": ROLE,
                    }
                ],
                Orchestrator=EKS,
                TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": 20},
                NodeRecovery="Automatic",
            )
        client.wait_until_in_service(args.cluster, timeout=180)
        policy = client.get_checkpoint_policy(args.cluster)
        wanted = {"S3BaseUri": f"{args.s3_base}/{args.cluster}", "PersistEverySteps": args.s3_every}
        if any(policy.get(k) != v for k, v in wanted.items()):
            try:
                client.put_checkpoint_policy(args.cluster, **wanted, InMemoryRetention=3)
            except ClusterError as exc:
                raise SystemExit(f"cannot set the checkpoint policy: {exc}") from exc
            client.wait_until_in_service(args.cluster, timeout=180)
        urls = client.agent_urls(args.cluster)
    if not urls:
        raise SystemExit(f"cluster {args.cluster} has no running agent")
    return urls


def launch(args: argparse.Namespace) -> int:
    """Run the job on the cluster's nodes with ``hyperpod-sim job run``: one process per rank,
    spread over ``--ranks`` nodes (or fewer nodes with several processes each), resumed by itself
    after a failure (``--auto-resume``). The exit status is the job's."""
    urls = ensure_cluster(args)
    nodes = min(args.ranks, len(urls))
    if args.ranks % nodes:
        raise SystemExit(f"{args.ranks} ranks do not spread evenly over {nodes} nodes")
    argv = [
        sys.executable, "-m", "hyperpod_sim", "job", "run", "--endpoint-url", args.endpoint_url,
        "--cluster", args.cluster, "--nodes", str(nodes), "--procs-per-node", str(args.ranks // nodes),
    ]  # fmt: skip
    if args.auto_resume:
        argv += ["--auto-resume", "--max-restarts", str(args.max_restarts)]
    argv += ["--", sys.executable, str(Path(__file__).resolve()), "--train", *sys.argv[1:]]
    return subprocess.call(argv, cwd=ROOT)


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from hyperpod_sim.sdk.checkpoint import (
        CheckpointNotFound,
        TieredCheckpointConfig,
        TieredStorageWriter,
        load_latest,
    )

    # Everything about the job comes from the environment `job run` gives each rank, as torchrun's.
    args.rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("HPSIM_JOB_ATTEMPT", "1"))
    dist.init_process_group("gloo", init_method="env://", rank=args.rank, world_size=args.ranks)
    # Checkpoints get their own process group: async_save runs its collectives in a background
    # thread while training runs its own on the default group.
    checkpoint_group = dist.new_group(backend="gloo")
    torch.manual_seed(args.rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = TieredCheckpointConfig(namespace=f"{args.cluster}-example-{args.ranks}", world_size=args.ranks)
    state: dict[str, Any] = {
        f"rank{args.rank}": {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        "progress": {"step": 0},
    }
    start = 0
    resumed: dict[str, Any] = {}
    try:
        loaded = load_latest(state, config, process_group=checkpoint_group)
        model.load_state_dict(state[f"rank{args.rank}"]["model"])
        optimizer.load_state_dict(state[f"rank{args.rank}"]["optimizer"])
        start = int(state["progress"]["step"])
        resumed = {"step": loaded.step, "tiers": loaded.served_by, "seconds": round(loaded.seconds, 3)}
        if args.rank == 0:
            print(f"resumed from step {loaded.step} ({loaded.served_by}, {loaded.seconds:.2f} s)", flush=True)
    except CheckpointNotFound:
        if args.rank == 0:
            print("no checkpoint yet: starting from step 0", flush=True)

    generator = torch.Generator().manual_seed(1234 + args.rank)
    target = torch.nn.Linear(16, 1)
    pending = None
    stalls: list[float] = []
    for step in range(start + 1, args.steps + 1):
        inputs = torch.randn(32, 16, generator=generator)
        with torch.no_grad():
            labels = target(inputs)
        loss = torch.nn.functional.mse_loss(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():  # data parallel: average the gradients
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= args.ranks
        optimizer.step()
        if step % args.save_every == 0:
            if pending is not None:
                pending.result()  # one checkpoint in flight at a time
            state["progress"] = {"step": step}
            state[f"rank{args.rank}"] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            writer = TieredStorageWriter(config, step=step)
            began = time.perf_counter()
            pending = async_save(state, storage_writer=writer, process_group=checkpoint_group)
            stalls.append(time.perf_counter() - began)
            if args.rank == 0:
                print(
                    f"step {step:4d}  loss {loss.item():.4f}  "
                    f"checkpoint (training blocked {stalls[-1] * 1e3:.1f} ms)",
                    flush=True,
                )
        if args.fail_at is not None and step == args.fail_at and attempt == 1:
            if args.rank == 0:
                print(f"simulated failure at step {step}", flush=True)
            os._exit(3)  # no flush: whatever was not committed is lost, as in a crash
    if pending is not None:
        pending.result()  # the last checkpoint is committed before exit
    if args.report:
        Path(f"{args.report}.{args.rank}").write_text(
            json.dumps(
                {"rank": args.rank, "start": start, "end": args.steps, "resumed": resumed, "stalls": stalls}
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    if args.rank == 0:
        print(f"done: steps {start + 1}..{args.steps}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--endpoint-url", default=os.environ.get("HPSIM_ENDPOINT_URL", "http://127.0.0.1:8080")
    )
    parser.add_argument("--cluster", default="example")
    parser.add_argument("--ranks", type=int, default=2, choices=[1, 2, 3, 4])
    parser.add_argument("--nodes", type=int, help="nodes of the cluster (default: one per rank)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=2, help="checkpoint to memory every N steps")
    parser.add_argument("--s3-every", type=int, default=10, help="persist to S3 every N steps")
    parser.add_argument("--s3-base", default="s3://hpsim-checkpoints", help="S3 base URI (bucket and prefix)")
    parser.add_argument(
        "--fail-at", type=int, help="every rank of the job's first attempt exits abruptly after this step"
    )
    parser.add_argument(
        "--auto-resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart the job after a failure, from its newest checkpoint (default: on)",
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts at most (default 3)")
    parser.add_argument("--report", help="write each rank's summary to REPORT.<rank> (JSON)")
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # a rank, under job run
    args = parser.parse_args()
    args.nodes = args.nodes or args.ranks
    return train(args) if args.train else launch(args)


if __name__ == "__main__":
    sys.exit(main())
