"""Reads of what is on S3 for the S3 tier (hyperpod_sim/agents/s3/tier.py): who wrote each step
of a namespace (the agents, with their commit marker, or the trainer through the library, with
none), and a shard of a step the library wrote itself."""

from __future__ import annotations

from hyperpod_sim.agents.s3.objects import S3Objects
from hyperpod_sim.agents.store import ShardKey
from hyperpod_sim.contracts.s3layout import (
    WRITTEN_BY_AGENTS,
    WRITTEN_BY_TRAINER,
    S3Target,
    step_of_key,
    trainer_steps,
)
from hyperpod_sim.contracts.shards import checksum_of


def written_steps(target: S3Target, name: str, keys: list[str], world_size: int | None) -> dict[int, str]:
    """Who wrote each step of ``name`` on S3, from the keys under its prefix."""
    marker_prefix = target.marker_prefix(name)
    trainer = trainer_steps(keys, target.namespace_prefix(name), world_size)
    written = dict.fromkeys(trainer, WRITTEN_BY_TRAINER)
    for key in keys:
        if key.startswith(marker_prefix) and (s := step_of_key(key)) is not None:
            written[s] = WRITTEN_BY_AGENTS
    return written


def read_trainer_written(
    objects: S3Objects, target: S3Target, key: ShardKey, world_size: int | None
) -> tuple[bytes, str] | None:
    """A shard of a step the trainer wrote through the library (no marker), if that step is
    complete on S3; its checksum is computed here (the library stores none)."""
    if world_size is None:
        return None
    prefix = target.namespace_prefix(key.namespace)
    layout = trainer_steps(objects.keys(target.bucket, prefix), prefix, world_size).get(key.step)
    if layout is None:
        return None
    shard_key = target.shard_key(key.namespace, key.rank, key.step, world_size + 1, layout=layout)
    data = objects.get(target.bucket, shard_key)
    return None if data is None else (data, checksum_of(data))
