"""PyTorch Distributed Checkpoint (DCP) storage for hyperpod-sim's tiered checkpointing.

Names as in ``amzn-sagemaker-checkpointing`` (docs/sdk.md has them side by side):
``TieredCheckpointConfig`` (namespace, world size, optional S3 base path), ``TieredStorageWriter``
(one per step) and ``TieredStorageReader`` (a given step, or the latest), used with ``dcp.save``,
``dcp.async_save`` and ``dcp.load``; ``load_latest`` loads the newest complete step, falling back to
older ones.

One shard per rank per step, in the agent's memory: the rank's tensors as raw bytes (C order,
64-byte aligned) followed by its non-tensor values, each a record of ``sdk.metadata.encode_value``
(JSON, or for what JSON cannot hold a ``torch.save`` record that loads with
``weights_only=True``). The metadata (JSON, ``hyperpod_sim/sdk/metadata.py``) is the namespace's last rank,
written by the coordinator once every rank's shard is committed: a step is complete, and listed
by ``latest``, only then.

Loading runs no code from a tier: DCP's default planner would load non-tensor values with
``torch.load(weights_only=False)``; the reader decodes them itself (``decode_value``) and never
hands them to ``load_bytes``. Every copy's checksum is verified before a byte of it is decoded
(for a mapped copy, the value records are copied out and hashed as part of the shard); a copy
that fails either check is an integrity failure, and the reader moves on to the next copy, then
``load_latest`` to an older step; ``reader.rejected`` and ``Loaded.rejected`` / ``skipped`` say why.

``async_save``: the writer is its own DCP stager. ``stage`` reserves the rank's shard in the
agent's shared memory and copies every tensor into it (device-to-host directly for CUDA tensors,
into memory registered as pinned once); that copy is all ``async_save`` blocks on. Planning,
commit, replication and S3 persistence happen after the future is handed back; wait on it (or
call ``TieredStorageWriter.flush()``) before exiting.

The parts: ``hyperpod_sim/sdk/checkpoint_config.py`` (the config, the agent client, the errors),
``hyperpod_sim/sdk/dcp_writer.py`` (the writer and stager), ``hyperpod_sim/sdk/dcp_reader.py`` (the reader),
``hyperpod_sim/sdk/s3direct.py`` (a committed shard read straight from S3); this module is their one entry and
``load_latest``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

try:
    import torch
except ModuleNotFoundError as exc:  # the SDK installed without the trainer extra: say which
    raise ModuleNotFoundError(
        "hyperpod_sim.sdk.checkpoint needs torch: pip install 'hyperpod-sim[trainer]'", name=exc.name
    ) from None
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hyperpod_sim.sdk.checkpoint_config import (
    CheckpointNotFound,
    IntegrityError,
    TieredCheckpointConfig,
    client_for,
    step_of,
)
from hyperpod_sim.sdk.dcp_reader import TieredStorageReader
from hyperpod_sim.sdk.dcp_writer import TieredStorageWriter

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointNotFound",
    "IntegrityError",
    "Loaded",
    "TieredCheckpointConfig",
    "TieredStorageReader",
    "TieredStorageWriter",
    "client_for",
    "load_latest",
    "step_of",
]


@dataclass(frozen=True)
class Loaded:
    """What ``load_latest`` loaded: the step, the tier that served each saved rank's shard read,
    the copies of that step it did not use and why (rank -> reasons), the newer steps it tried
    and skipped (step -> why), and the world size of the job that saved the step (another than
    this job's: loaded resharded)."""

    step: int
    served_by: dict[int, str]
    seconds: float
    rejected: dict[int, list[str]] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    saved_world_size: int | None = None


def load_latest(
    state_dict: dict[str, Any],
    config: TieredCheckpointConfig,
    *,
    step: int | None = None,
    max_steps: int = 10,
    process_group: dist.ProcessGroup | None = None,
) -> Loaded:
    """Load the newest complete step (or ``step``) into ``state_dict`` in place; on any miss or
    bad copy of any rank, every rank moves on to the next older step together.
    CheckpointNotFound when none loads."""
    from torch.distributed.checkpoint.state_dict_loader import load

    started = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    candidates = [step] if step is not None else config.client().latest(config.namespace, limit=max_steps)
    if distributed:
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0, group=process_group)
        candidates = shared[0]
    skipped: dict[int, str] = {}
    for candidate in candidates:
        reader = TieredStorageReader(config, step=candidate)
        ok = True
        try:
            load(state_dict, storage_reader=reader, process_group=process_group)
        except (Exception, CheckpointException) as exc:  # the latter is a BaseException
            skipped[candidate] = reader.failure or str(exc)[:2000]
            log.warning(
                "step %d of %r did not load (%s); trying an older one",
                candidate, config.namespace, skipped[candidate],
            )  # fmt: skip
            ok = False
        if distributed:
            flag = torch.tensor([1 if ok else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
            if ok and not flag.item():
                skipped[candidate] = "another rank could not load it"
            ok = bool(flag.item())
        if ok:
            return Loaded(
                candidate,
                dict(reader.served_by),
                time.perf_counter() - started,
                rejected={rank: list(reasons) for rank, reasons in reader.rejected.items()},
                skipped=skipped,
                saved_world_size=reader.saved_world_size,
            )
    raise CheckpointNotFound(
        f"no step of namespace {config.namespace!r} could be loaded (tried {candidates}): "
        + "; ".join(f"step {s}: {why}" for s, why in skipped.items())
    )
