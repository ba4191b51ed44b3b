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
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import os
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

try:
    import torch
except ModuleNotFoundError as exc:  # the SDK installed without the trainer extra: say which
    raise ModuleNotFoundError(
        "hyperpod_sim.sdk.checkpoint needs torch: pip install 'hyperpod-sim[trainer]'", name=exc.name
    ) from None
import torch.distributed as dist
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hyperpod_sim.sdk import metadata as codec
from hyperpod_sim.sdk.agent import (
    AgentClient,
    AgentError,
    FastWrite,
    checksum,
    discover_agent_url,
    shm_root_from,
)
from hyperpod_sim.sdk.metadata import ShardRef, UndecodableValue

log = logging.getLogger(__name__)

ALIGN = 64
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

    ``world_size``: ranks of the job (the namespace holds ``world_size + 1`` ranks: the metadata
    is the last). ``agent_url``: this node's agent (default: from the environment, see
    ``sdk.agent.discover_agent_url``). ``s3_tier_base_path``: the cluster's S3 base URI; when set,
    a reader whose agent has no good copy reads committed steps from S3 directly. ``fast_path``:
    write and read the agent's shared memory directly when it is reachable from this process.
    ``shm_root``: the only directory whose files the fast path maps (default
    ``HPSIM_SIMULATION__SHM_ROOT``, else ``/dev/shm/hpsim``; see ``sdk.agent.open_shared``).
    """

    namespace: str
    world_size: int
    agent_url: str | None = None
    s3_tier_base_path: str = ""
    steps_retained: int = 3
    fast_path: bool = True
    shm_root: str | None = None
    logger: logging.Logger | None = field(default=None, repr=False)

    def client(self) -> AgentClient:
        return client_for(
            self.agent_url or discover_agent_url(), fast_path=self.fast_path, shm_root=self.shm_root
        )

    @property
    def metadata_rank(self) -> int:
        return self.world_size


def step_of(checkpoint_id: str | os.PathLike[str] | None) -> int | None:
    """The step of a ``step_N`` checkpoint id (or path ending in it); None for None."""
    if checkpoint_id is None:
        return None
    match = _STEP_ID.search(str(checkpoint_id))
    if match is None:
        raise ValueError(f"checkpoint id {str(checkpoint_id)!r} does not end in step_<N>")
    return int(match.group(1))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


# Reservations are rounded up to this: a rank's size stays the same from step to step when its
# non-tensor values grow by a few bytes, so the agent's spares (made at the rank's last size) and
# this process's mappings (kept per buffer and size) fit the next save. The commit gives the rest
# back.
RESERVE_GRAIN = 64 << 10


def _reserve_size(nbytes: int) -> int:
    return -(-nbytes // RESERVE_GRAIN) * RESERVE_GRAIN


def _plain_tensor(value: Any) -> bool:
    return type(value) is torch.Tensor or (
        isinstance(value, torch.nn.Parameter) and type(value.data) is torch.Tensor
    )


@dataclass
class _Staged:
    """A rank's shard being written: the open reservation and where each staged tensor went."""

    write: FastWrite
    base: int  # address of the mapping
    end: int  # bytes used by staged tensors


class TieredStorageWriter(StorageWriter, AsyncStager):
    """DCP storage writer for one step (``SageMakerTieredStorageWriter``'s counterpart)."""

    # Staging is finished when stage() returns: async_save must not call synchronize_staging.
    _synchronize_after_execute = False

    def __init__(self, checkpoint_config: TieredCheckpointConfig, step: int | None = None) -> None:
        super().__init__()
        self.config = checkpoint_config
        self.step = step
        self.rank = _rank()
        self.is_coordinator = False
        self._client = checkpoint_config.client()
        self._staged: _Staged | None = None
        self._records: dict[str, bytes] = {}  # fqn -> its value's record, encoded when staged
        self._namespace_ready = False
        self.stage_seconds = 0.0  # how long stage() blocked (what async_save costs the trainer)

    # -- StorageWriter

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

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"step_{self.step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("the step to save is not set: pass step= or checkpoint_id='step_<N>'")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", _rank()))
        self._ensure_namespace()

    def _ensure_namespace(self) -> None:
        if not self._namespace_ready:
            self._client.ensure_namespace(
                self.config.namespace,
                num_ranks=self.config.world_size + 1,
                steps_retained=self.config.steps_retained,
            )
            self._namespace_ready = True

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    # -- staging (async_save)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy the state dict's tensors into this rank's shard in the agent's shared memory and
        return the same structure with those copies in place of the tensors."""
        started = time.perf_counter()
        if self.step is None:
            raise ValueError("the step to save is not set: pass step= to the writer")
        leaves = list(_leaves(state_dict))
        tensors = [leaf for leaf in leaves if _plain_tensor(leaf)]
        if len(tensors) != sum(isinstance(leaf, torch.Tensor) for leaf in leaves):
            # DTensor / ShardedTensor: DCP's own staging (a copy in CPU memory), saved by copy.
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            staged_copy: dict[str, Any] = DefaultStager(StagingOptions(False, False, False, False)).stage(
                state_dict
            )  # type: ignore[assignment]
            self.stage_seconds = time.perf_counter() - started
            return staged_copy
        self._ensure_namespace()
        offsets: dict[int, int] = {}
        end = 0
        for tensor in tensors:
            if id(tensor) not in offsets:
                end = _aligned(end)
                offsets[id(tensor)] = end
                end += tensor.numel() * tensor.element_size()
        # The non-tensor values, encoded now (a snapshot, as DCP's stager takes), and room for them.
        self._records = _value_records(state_dict)
        extra = sum(len(record) + ALIGN for record in self._records.values())
        rank = self.rank = _rank()
        write = self._client.reserve(
            self.config.namespace, rank, self.step, _reserve_size(_aligned(end) + extra + ALIGN)
        )
        if write is None:  # no fast path: stage into process memory, as DCP does by default
            staged_plain: dict[str, Any] = _map_tensors(state_dict, lambda t: t.detach().to("cpu", copy=True))
            self.stage_seconds = time.perf_counter() - started
            return staged_plain
        buffer = (
            torch.frombuffer(write.view, dtype=torch.uint8)
            if write.size
            else torch.empty(0, dtype=torch.uint8)
        )
        if any(t.is_cuda for t in tensors):
            write.pin_for_cuda()
        copies: dict[int, torch.Tensor] = {}

        def place(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in copies:
                return copies[id(tensor)]
            start = offsets[id(tensor)]
            nbytes = tensor.numel() * tensor.element_size()
            dest = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            dest.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
            copies[id(tensor)] = dest
            return dest

        staged: dict[str, Any] = _map_tensors(state_dict, place)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        self._staged = _Staged(write, buffer.data_ptr() if write.size else 0, _aligned(end))
        self.stage_seconds = time.perf_counter() - started
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: staging is complete when ``stage`` returns."""
        return None

    def close(self) -> None:
        """Nothing to release: the agent client and its mappings are shared per process."""
        return None

    # -- writing

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write(plan, planner))
        except Exception as exc:
            if self._staged is not None:
                self._client.abort(self._staged.write.token)
                self._staged = None
            future.set_exception(exc)  # type: ignore[arg-type]
        return future

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        assert self.step is not None
        items: list[tuple[WriteItem, Any]] = [(item, self._data(item, planner)) for item in plan.items]
        self._records = {}
        staged = self._staged
        self._staged = None
        if staged is not None:
            results = self._write_staged(staged, items)
            if results is not None:
                return results
        # Not staged (dcp.save) or the staged shard could not take everything: lay it out now.
        layout: list[tuple[WriteItem, Any, int, int]] = []
        end = 0
        for item, data in items:
            payload = _payload(item, data)
            end = _aligned(end)
            layout.append((item, payload, end, _nbytes(payload)))
            end += _nbytes(payload)
        write = self._client.reserve(self.config.namespace, self.rank, self.step, _reserve_size(end))
        if write is not None:
            target = (
                torch.frombuffer(write.view[:end], dtype=torch.uint8)
                if end
                else torch.empty(0, dtype=torch.uint8)
            )
            if any(isinstance(p, torch.Tensor) and p.is_cuda for _, p, _, _ in layout):
                write.pin_for_cuda()
            for _, payload, offset, length in layout:
                _copy_into(target, offset, payload, length)
            if any(isinstance(p, torch.Tensor) and p.is_cuda for _, p, _, _ in layout):
                torch.cuda.synchronize()
            del target
            self._client.commit(write, size=end)
        else:
            body = bytearray(end)
            target = torch.frombuffer(body, dtype=torch.uint8) if end else torch.empty(0, dtype=torch.uint8)
            for _, payload, offset, length in layout:
                _copy_into(target, offset, payload, length)
            if any(isinstance(p, torch.Tensor) and p.is_cuda for _, p, _, _ in layout):
                torch.cuda.synchronize()  # device-to-host copies into pageable memory, too
            del target
            self._client.put(self.config.namespace, self.rank, self.step, body)
        return [_result(item, self.rank, offset, length, payload) for item, payload, offset, length in layout]

    def _write_staged(self, staged: _Staged, items: list[tuple[WriteItem, Any]]) -> list[WriteResult] | None:
        """Results for a shard staged in shared memory: tensors are already in place; the
        non-tensor values go after them. None (staging aborted) if something does not fit."""
        write = staged.write
        buffer = (
            torch.frombuffer(write.view, dtype=torch.uint8)
            if write.size
            else torch.empty(0, dtype=torch.uint8)
        )
        results: list[WriteResult] = []
        cursor = staged.end
        for item, data in items:
            if item.type == WriteItemType.BYTE_IO:
                payload = _payload(item, data)
                length = _nbytes(payload)
                cursor = _aligned(cursor)
                if cursor + length > write.size:
                    break
                _copy_into(buffer, cursor, payload, length)
                results.append(_result(item, self.rank, cursor, length, payload))
                cursor += length
                continue
            tensor = data.detach() if isinstance(data, torch.Tensor) else None
            offset = tensor.data_ptr() - staged.base if tensor is not None and not tensor.is_cuda else -1
            length = tensor.numel() * tensor.element_size() if tensor is not None else 0
            if tensor is None or not tensor.is_contiguous() or not 0 <= offset <= write.size - length:
                break  # not one of the staged copies
            results.append(_result(item, self.rank, offset, length, tensor))
        else:
            del buffer
            self._client.commit(write, size=cursor)
            return results
        del buffer
        self._client.abort(write.token)
        return None

    def _data(self, item: WriteItem, planner: SavePlanner) -> Any:
        return (
            self._record(item, planner) if item.type == WriteItemType.BYTE_IO else planner.resolve_data(item)
        )

    def _record(self, item: WriteItem, planner: SavePlanner) -> bytes:
        """A non-tensor value's record (``sdk.metadata.encode_value``), never DCP's ``torch.save``."""
        fqn = item.index.fqn
        if fqn in self._records:
            return self._records[fqn]
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:  # DefaultSavePlanner and its subclasses: the value itself
            value = lookup(item.index)
        else:  # a planner of its own: the torch.save bytes it made in this process, back to a value
            data = planner.resolve_data(item)
            value = torch.load(data, weights_only=True) if isinstance(data, io.BytesIO) else data
        return codec.encode_value(value, fqn=fqn)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator writes the metadata, once every rank's shard is committed."""
        assert self.step is not None
        storage: dict[MetadataIndex, ShardRef] = {}
        for rank_results in results:
            for result in rank_results:
                storage[result.index] = result.storage_data
        metadata.storage_data = storage
        self._client.put(self.config.namespace, self.config.metadata_rank, self.step, codec.encode(metadata))


def _value_records(state_dict: dict[str, Any]) -> dict[str, bytes]:
    """The record of every non-tensor value, by the fqn DCP's planner gives it (it flattens the
    state dict with this same traversal)."""
    records: dict[str, bytes] = {}

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            fqn = ".".join(map(str, path))
            records[fqn] = codec.encode_value(value, fqn=fqn)

    traverse_state_dict(state_dict, visit)
    return records


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return (
            type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
            if type(obj) is not dict
            else {k: _map_tensors(v, fn) for k, v in obj.items()}
        )
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn) for v in obj)
    return obj


def _payload(item: WriteItem, data: Any) -> torch.Tensor | memoryview:
    if item.type == WriteItemType.BYTE_IO:
        return memoryview(data)  # a record of sdk.metadata.encode_value
    tensor: torch.Tensor = data.detach()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _nbytes(payload: torch.Tensor | memoryview) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return payload.nbytes


def _copy_into(buffer: torch.Tensor, offset: int, payload: torch.Tensor | memoryview, length: int) -> None:
    if not length:
        return
    if isinstance(payload, torch.Tensor):
        buffer[offset : offset + length].view(payload.dtype).view(payload.shape).copy_(
            payload, non_blocking=payload.is_cuda
        )
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only record: only read from
            source = torch.frombuffer(payload, dtype=torch.uint8)
        buffer[offset : offset + length].copy_(source)


def _result(item: WriteItem, rank: int, offset: int, length: int, payload: Any) -> WriteResult:
    if isinstance(payload, torch.Tensor):
        ref = ShardRef(rank, offset, length, codec.dtype_name(payload.dtype), tuple(payload.shape))
    else:
        ref = ShardRef(rank, offset, length)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=ref)


class TieredStorageReader(StorageReader):
    """DCP storage reader (``SageMakerTieredStorageReader``'s counterpart): a given step, or the
    newest complete one. ``served_by`` tells, per rank shard read, which tier served it;
    ``rejected``, per rank, every copy not used and why (``"memory: checksum mismatch"``)."""

    def __init__(self, checkpoint_config: TieredCheckpointConfig, step: int | None = None) -> None:
        super().__init__()
        self.config = checkpoint_config
        self.step = step
        self._client = checkpoint_config.client()
        self.storage_data: dict[MetadataIndex, ShardRef] = {}
        self.served_by: dict[int, str] = {}
        self.rejected: dict[int, list[str]] = {}
        self.failure: str | None = None  # why the last read failed

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = step_of(checkpoint_id)
        if step is not None:
            self.step = step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TieredStorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        candidates = (
            [self.step] if self.step is not None else self._client.latest(self.config.namespace, limit=10)
        )
        problems = []
        rank = self.config.metadata_rank
        for step in candidates:
            for data, tier in self._copies(rank, step, local=True):
                try:
                    metadata = codec.decode(data)
                except ValueError as exc:
                    self._reject(rank, step, tier, str(exc))
                    continue
                self.step = step
                return metadata
            problems.append(f"step {step}: {self._no_copy(rank, step)}")
        self.failure = (
            f"no loadable step of namespace {self.config.namespace!r}: {'; '.join(problems) or 'none saved'}"
        )
        raise CheckpointNotFound(self.failure)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        future: Future[None] = Future()
        try:
            self._read(plan, planner)
            future.set_result(None)
        except Exception as exc:
            self.failure = str(exc)
            future.set_exception(exc)  # type: ignore[arg-type]
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        assert self.step is not None
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items) and not _assigns_values(planner):
            raise TypeError(
                f"{type(planner).__name__} overrides load_bytes: the tiered reader decodes non-tensor "
                "values itself (never with torch.load(weights_only=False)) and assigns them as "
                "DefaultLoadPlanner does; use a planner that keeps DefaultLoadPlanner.load_bytes"
            )
        by_rank: dict[int, list[Any]] = {}
        for item in plan.items:
            by_rank.setdefault(self.storage_data[item.storage_index].rank, []).append(item)
        for rank, items in sorted(by_rank.items()):
            self._read_rank(rank, self.step, items, planner)

    def _read_rank(self, rank: int, step: int, items: list[Any], planner: LoadPlanner) -> None:
        """Apply a rank's items from the first copy that is intact: this node's copy, mapped (its
        checksum verified before anything in it is decoded), then the others ``_copies`` yields."""
        local = self._client.read_local(self.config.namespace, rank, step)
        if local is not None:
            where = f"{local.tier} (this node, mapped)"
            try:
                self._apply(items, local.view, planner, expected=local.checksum)
            except IntegrityError as exc:
                self._reject(rank, step, where, str(exc))
            else:
                self._served(rank, local.tier)
                return
            finally:
                with contextlib.suppress(BufferError):  # a view of it still alive: harmless
                    local.view.release()
                local.release()
        for data, tier in self._copies(rank, step, local=False):
            try:
                self._apply(items, data, planner)
            except IntegrityError as exc:
                self._reject(rank, step, tier, str(exc))
                continue
            self._served(rank, tier)
            return
        raise CheckpointNotFound(self._no_copy(rank, step))

    def _no_copy(self, rank: int, step: int) -> str:
        reasons = self.rejected.get(rank, [])
        return f"rank {rank} of step {step} of {self.config.namespace!r}: no good copy in any tier" + (
            f" (rejected: {'; '.join(reasons)})" if reasons else ""
        )

    def _reject(self, rank: int, step: int, where: str, why: str, *, integrity: bool = True) -> None:
        """Record (and log) a copy not used: an integrity failure, or a tier that could not answer."""
        self.rejected.setdefault(rank, []).append(f"{where}: {why}")
        kind = "integrity failure" if integrity else "unavailable"
        log.warning(
            "%s: %s copy of rank %d step %d of %r not used: %s",
            kind, where, rank, step, self.config.namespace, why,
        )  # fmt: skip

    def _served(self, rank: int, tier: str) -> None:
        self.served_by[rank] = tier
        log.info("rank %d of step %s of %r served by %s", rank, self.step, self.config.namespace, tier)

    def _apply(
        self, items: list[Any], data: Any, planner: LoadPlanner, *, expected: str | None = None
    ) -> None:
        """Load ``items`` from one copy of a shard; IntegrityError (nothing decoded) if the copy is
        not intact. ``expected``: the checksum of a copy that is mapped, not yet verified: the
        value records are copied out and hashed as part of the shard, so what is decoded is what
        was verified. Non-tensor values are decoded (``decode_value``: JSON, or PyTorch's
        allow-list unpickler) and assigned only once every item of the copy has loaded."""
        size = len(data)
        for item in items:
            ref = self.storage_data[item.storage_index]
            if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > size:
                raise IntegrityError(
                    f"{item.storage_index.fqn}: bytes {ref.offset}..{ref.offset + ref.length} lie outside "
                    f"the {size}-byte shard"
                )
        spans = [
            (ref.offset, ref.length)
            for item in items
            if item.type == LoadItemType.BYTE_IO
            for ref in [self.storage_data[item.storage_index]]
        ]
        records = _verified_records(data, spans, expected) if expected is not None else _records(data, spans)
        values: list[tuple[Any, Any]] = []
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                ref = self.storage_data[item.storage_index]
                try:
                    values.append((item, codec.decode_value(records[(ref.offset, ref.length)])))
                except UndecodableValue as exc:
                    raise IntegrityError(f"{item.storage_index.fqn}: {exc}") from exc
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: we only read from it
            source = torch.frombuffer(data, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            ref = self.storage_data[item.storage_index]
            fqn = item.storage_index.fqn
            if ref.dtype is None or ref.shape is None:
                raise IntegrityError(f"{fqn}: the metadata has no dtype or shape for a tensor")
            try:
                dtype = codec.dtype_of(ref.dtype)
                numel = 1
                for dim in ref.shape:
                    numel *= dim
                if numel * dtype.itemsize != ref.length or min(ref.shape, default=0) < 0:
                    raise IntegrityError(
                        f"{fqn}: {ref.length} bytes cannot hold {ref.dtype}{list(ref.shape)}"
                    )
                src = source[ref.offset : ref.offset + ref.length].view(dtype).view(ref.shape)
            except (RuntimeError, ValueError) as exc:
                raise IntegrityError(f"{fqn}: {exc}") from exc
            src = narrow_tensor_by_index(src, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != src.size():
                raise ValueError(f"{fqn}: stored {tuple(src.size())}, wanted {tuple(target.size())}")
            target.copy_(src)
            planner.commit_tensor(item, target)
            del src
        del source
        for item, value in values:
            _assign(planner, item, value)

    def _copies(self, rank: int, step: int, *, local: bool) -> Iterator[tuple[bytes, str]]:
        """A rank's shard of a step, copy after copy, each in this process's memory and verified
        against its checksum (a copy that is not is recorded in ``rejected`` and skipped): this
        node's shared memory (``local``), the agent (which tries its own copy, the other agents'
        and replicas, then S3), then S3 directly (with ``s3_tier_base_path``)."""
        if local:
            found = self._client.read_local(self.config.namespace, rank, step)
            if found is not None:
                try:
                    data = bytes(found.view)
                finally:
                    with contextlib.suppress(BufferError):
                        found.view.release()
                    found.release()
                if checksum(data) == found.checksum:
                    yield data, found.tier
                else:
                    self._reject(rank, step, f"{found.tier} (this node, mapped)", "checksum mismatch")
        try:
            remote = self._client.get(self.config.namespace, rank, step)
        except AgentError as exc:  # refused, unreachable, or a copy that arrived corrupted
            self._reject(rank, step, "agent", str(exc), integrity="corrupted" in str(exc))
            remote = None
        if remote is not None:
            yield remote
        if self.config.s3_tier_base_path:
            try:
                direct = _read_s3(self.config, rank, step)
            except Exception as exc:  # S3 unreachable, a marker that is not one, ...
                why = f"{type(exc).__name__}: {str(exc)[:300]}"
                self._reject(rank, step, "s3-direct", why, integrity=False)
                direct = None
            if direct is not None:
                yield direct, "s3-direct"


def _records(data: Any, spans: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
    view = memoryview(data)
    return {(offset, length): bytes(view[offset : offset + length]) for offset, length in spans}


def _verified_records(data: Any, spans: list[tuple[int, int]], expected: str) -> dict[tuple[int, int], bytes]:
    """The bytes of ``spans`` copied out of a mapped shard, and the shard's checksum computed with
    those copies in their places, so the records decoded are exactly the bytes verified even if
    the mapping changed meanwhile. IntegrityError on a mismatch."""
    view = memoryview(data)
    merged: list[list[int]] = []
    for offset, length in sorted(spans):
        if merged and offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length)
        else:
            merged.append([offset, offset + length])
    digest = xxhash.xxh3_128()
    copies: list[tuple[int, bytes]] = []
    position = 0
    for start, stop in merged:
        digest.update(view[position:start])
        copy = bytes(view[start:stop])
        digest.update(copy)
        copies.append((start, copy))
        position = stop
    digest.update(view[position:])
    if base64.b64encode(digest.digest()).decode("ascii") != expected:
        raise IntegrityError("checksum mismatch")
    records: dict[tuple[int, int], bytes] = {}
    for offset, length in spans:
        start, copy = next((s, c) for s, c in copies if s <= offset and offset + length <= s + len(c))
        records[(offset, length)] = copy[offset - start : offset - start + length]
    return records


def _assigns_values(planner: LoadPlanner) -> bool:
    """Whether values can be assigned as DefaultLoadPlanner.load_bytes does (it is not overridden)."""
    default = DefaultLoadPlanner.load_bytes
    return isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is default


def _assign(planner: LoadPlanner, item: Any, value: Any) -> None:
    """What DefaultLoadPlanner.load_bytes does with a value, given the value decoded safely."""
    assert isinstance(planner, DefaultLoadPlanner)
    fqn = item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def _read_s3(config: TieredCheckpointConfig, rank: int, step: int) -> bytes | None:
    """A shard straight from S3 (endpoint and credentials from the boto3 chain), checked against
    the step's commit marker; None if there is none (or it does not match), an exception if S3
    cannot be read."""
    import json

    from hyperpod_sim.agents.s3objects import S3Objects, S3Target, ShardObject

    target = S3Target.from_policy({"base_uri": config.s3_tier_base_path})
    assert target is not None
    objects = S3Objects(
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
        region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    try:
        raw = objects.get(target.bucket, target.marker_key(config.namespace, step))
        if raw is None:
            return None
        shard = next((d for d in json.loads(raw)["shards"] if d["rank"] == rank), None)
        return None if shard is None else objects.get_verified(target.bucket, ShardObject.from_doc(shard))
    finally:
        objects.close()


@dataclass(frozen=True)
class Loaded:
    """What ``load_latest`` loaded: the step, the tier that served each rank shard read, the
    copies of that step it did not use and why (rank -> reasons), and the newer steps it tried
    and skipped (step -> why)."""

    step: int
    served_by: dict[int, str]
    seconds: float
    rejected: dict[int, list[str]] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)


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
            )
    raise CheckpointNotFound(
        f"no step of namespace {config.namespace!r} could be loaded (tried {candidates}): "
        + "; ".join(f"step {s}: {why}" for s, why in skipped.items())
    )
