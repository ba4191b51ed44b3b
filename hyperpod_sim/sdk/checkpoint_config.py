"""The configuration of a job's tiered checkpoints (``TieredCheckpointConfig``), the agent client
it uses, and the errors the DCP writer and reader raise (``sdk/checkpoint.py`` has the overview)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch.distributed as dist

from hyperpod_sim.sdk.agent import AgentClient, discover_agent_url, shm_root_from

_STEP_ID = re.compile(r"(?:^|/)step_(\d+)/?$")
_clients: dict[tuple[str, bool, str], AgentClient] = {}


class CheckpointNotFound(FileNotFoundError):
    """No complete step could be loaded from any tier."""


class IntegrityError(ValueError):
    """A copy of a shard not to use: its checksum does not match, a value in it does not decode,
    or its metadata places an item outside it. The reader moves on to another copy."""


def client_for(url: str, *, fast_path: bool = True, shm_root: str | None = None) -> AgentClient:
    """One client per agent URL and process, so mapped buffers are reused from step to step."""
    root = shm_root or shm_root_from()
    key = (url, fast_path, root)
    if key not in _clients:
        _clients[key] = AgentClient(url, fast_path=fast_path, shm_root=root)
    return _clients[key]


@dataclass
class TieredCheckpointConfig:
    """What ``SageMakerCheckpointConfig`` is to the library: the job's checkpoint namespace.

    ``world_size``: ranks of this job (a namespace it creates holds ``world_size + 1`` ranks: the
    metadata is the last). A step saved by a job of another world size loads resharded into this
    job's sharding; this job saves in the namespace when it has room for ``world_size`` ranks
    (docs/sdk.md#resharding). ``max_world_size``: the most ranks a job of this namespace will
    have, when it may grow: the namespace is created with room for them. ``agent_url``: this
    node's agent (default: from the environment, see ``sdk.agent.discover_agent_url``).
    ``s3_tier_base_path``: the cluster's S3 base URI; when set, a reader whose agent has no good
    copy reads committed steps from S3 directly. ``fast_path``: write and read the agent's shared
    memory directly when it is reachable from this process. ``shm_root``: the only directory
    whose files the fast path maps (default ``HPSIM_SIMULATION__SHM_ROOT``, else
    ``/dev/shm/hpsim``; see ``sdk.agent.open_shared``).
    """

    namespace: str
    world_size: int
    agent_url: str | None = None
    s3_tier_base_path: str = ""
    steps_retained: int = 3
    max_world_size: int | None = None
    fast_path: bool = True
    shm_root: str | None = None
    logger: logging.Logger | None = field(default=None, repr=False)

    def client(self) -> AgentClient:
        return client_for(
            self.agent_url or discover_agent_url(), fast_path=self.fast_path, shm_root=self.shm_root
        )

    @property
    def namespace_ranks(self) -> int:
        """The ranks of a namespace this job creates: room for its world size (or
        ``max_world_size``) and the metadata rank."""
        return max(self.world_size, self.max_world_size or 0) + 1


def step_of(checkpoint_id: str | os.PathLike[str] | None) -> int | None:
    """The step of a ``step_N`` checkpoint id (or path ending in it); None for None."""
    if checkpoint_id is None:
        return None
    match = _STEP_ID.search(str(checkpoint_id))
    if match is None:
        raise ValueError(f"checkpoint id {str(checkpoint_id)!r} does not end in step_<N>")
    return int(match.group(1))


class StepCheckpointIds:
    """What the tiered writer and reader answer DCP alike: a checkpoint id is ``step_N`` (or a path
    ending in it), and ``reset`` takes the step it names."""

    step: int | None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = step_of(checkpoint_id)
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return step_of(checkpoint_id) is not None
        except ValueError:
            return False


def current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
