"""What every trainer worker (``tests.dcp_worker``, ``tests.sdk_worker``) does alike: the options
``tests.helpers.run_ranks`` passes each rank, the gloo process group on loopback around the job,
and the result file. Light on purpose: the workers import it, not conftest."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist


def rank_parser() -> argparse.ArgumentParser:
    """A parser with the options every rank gets; a worker adds its own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (its node's)")
    parser.add_argument("--agent-url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--out", required=True)
    return parser


@contextmanager
def process_group(args: argparse.Namespace) -> Iterator[None]:
    """The job's gloo process group (master on ``--master-addr``:``--master-port``, default
    127.0.0.1), destroyed on the way out."""
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    dist.init_process_group(backend="gloo", rank=args.rank, world_size=args.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def write_result(args: argparse.Namespace, result: dict[str, Any]) -> None:
    Path(args.out).write_text(json.dumps(result))
