"""The DCP storage writer of a tiered checkpoint (``hyperpod_sim/sdk/checkpoint.py`` has the overview).

DCP calls it in the order ``torch/distributed/checkpoint/storage.py`` documents: ``reset``,
``set_up_storage_writer``, ``prepare_local_plan``, ``prepare_global_plan``, ``write_data`` (a
Future), ``finish``; with ``async_save`` the writer is also the stager (``stage`` first).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import secrets
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from hyperpod_sim.contracts.shards import UNUSED_RANK
from hyperpod_sim.sdk import metadata as codec
from hyperpod_sim.sdk.agent import FastWrite, ReservationLost
from hyperpod_sim.sdk.checkpoint_config import (
    StepCheckpointIds,
    TieredCheckpointConfig,
    current_rank,
)
from hyperpod_sim.sdk.device_copy import DeviceCopies
from hyperpod_sim.sdk.metadata import SaveRecord, ShardRef, ShardStamp

log = logging.getLogger(__name__)

ALIGN = 64
# The fqn of the write result each rank adds for its shard as a whole (a ``ShardStamp``): how the
# coordinator learns every rank's checksum. Never an item of the metadata.
SHARD_STAMP_FQN = "\x00hpsim-shard"


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


class TieredStorageWriter(StepCheckpointIds, StorageWriter, AsyncStager):
    """DCP storage writer for one step (``SageMakerTieredStorageWriter``'s counterpart)."""

    # Staging is finished when stage() returns: async_save must not call synchronize_staging.
    _synchronize_after_execute = False

    def __init__(self, checkpoint_config: TieredCheckpointConfig, step: int | None = None) -> None:
        super().__init__()
        self.config = checkpoint_config
        self.step = step
        self.rank = current_rank()
        self.is_coordinator = False
        self._client = checkpoint_config.client()
        self._staged: _Staged | None = None
        self._records: dict[str, bytes] = {}  # fqn -> its value's record, encoded when staged
        self._namespace_ranks: int | None = None  # the namespace's ranks, the metadata the last
        self.stage_seconds = 0.0  # how long stage() blocked (what async_save costs the trainer)

    # -- StorageWriter (reset and validate_checkpoint_id: StepCheckpointIds)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"step_{self.step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("the step to save is not set: pass step= or checkpoint_id='step_<N>'")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", current_rank()))
        self._ensure_namespace()

    def _ensure_namespace(self) -> int:
        """The namespace's ranks (created with ``config.namespace_ranks`` if it does not exist);
        AgentError if it has no room for this job's world size."""
        if self._namespace_ranks is None:
            answer = self._client.ensure_namespace(
                self.config.namespace,
                num_ranks=self.config.namespace_ranks,
                steps_retained=self.config.steps_retained,
                needs=self.config.world_size + 1,
            )
            self._namespace_ranks = answer.num_ranks
        return self._namespace_ranks

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator names this save of the step (a random id) in every rank's plan: each
        rank's shard is stored under it, and the metadata binds them together."""
        save = secrets.token_hex(16)
        return [dataclasses.replace(plan, storage_data=save) for plan in plans]

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
        rank = self.rank = current_rank()
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
            write.pin_for_cuda()  # once per mapped buffer, not per step (sdk/device_copy.py)
        copies: dict[int, torch.Tensor] = {}
        device_copies = DeviceCopies()  # CUDA tensors on a side stream

        def place(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) in copies:
                return copies[id(tensor)]
            start = offsets[id(tensor)]
            nbytes = tensor.numel() * tensor.element_size()
            dest = buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            device_copies.copy(dest, tensor.detach())
            copies[id(tensor)] = dest
            return dest

        staged: dict[str, Any] = _map_tensors(state_dict, place)
        device_copies.wait()
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
        save = plan.storage_data
        if not isinstance(save, str):
            raise RuntimeError(
                "the save plan names no save id (the planner dropped SavePlan.storage_data, which "
                "TieredStorageWriter.prepare_global_plan sets)"
            )
        items: list[tuple[WriteItem, Any]] = [(item, self._data(item, planner)) for item in plan.items]
        self._records = {}
        staged = self._staged
        self._staged = None
        if staged is not None:
            written = self._write_staged(staged, items, save)
            if written is not None:
                return written
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
            device_copies = DeviceCopies()
            for _, payload, offset, length in layout:
                _copy_into(target, offset, payload, length, device_copies)
            device_copies.wait()
            del target
            try:
                return self._laid_out(
                    layout, self._client.commit(write, size=end, save=save).checksum, end, save
                )
            except ReservationLost as exc:
                # The agent restarted between the reservation and the commit (at the same
                # endpoint, so the commit reached the new one): the shard goes over HTTP instead.
                log.info("the reservation for step %s was lost (%s); writing it over HTTP", self.step, exc)
        body = bytearray(end)
        target = torch.frombuffer(body, dtype=torch.uint8) if end else torch.empty(0, dtype=torch.uint8)
        device_copies = DeviceCopies()  # into pageable memory here
        for _, payload, offset, length in layout:
            _copy_into(target, offset, payload, length, device_copies)
        device_copies.wait()
        del target
        checksum = self._client.put(self.config.namespace, self.rank, self.step, body, save=save)
        return self._laid_out(layout, checksum, end, save)

    def _laid_out(
        self, layout: list[tuple[WriteItem, Any, int, int]], checksum: str, end: int, save: str
    ) -> list[WriteResult]:
        """The results of a shard written as ``layout`` says, and its stamp."""
        results = [
            _result(item, self.rank, offset, length, payload) for item, payload, offset, length in layout
        ]
        return [*results, _stamp(ShardStamp(self.rank, end, checksum, save))]

    def _write_staged(
        self, staged: _Staged, items: list[tuple[WriteItem, Any]], save: str
    ) -> list[WriteResult] | None:
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
            try:
                answer = self._client.commit(write, size=cursor, save=save)
            except ReservationLost as exc:
                # Reserved ahead and given up by the agent meanwhile (it restarted): the staged
                # copies are still mapped here, so lay them out again into a new reservation.
                log.info(
                    "the write reserved ahead for step %s was lost (%s); writing it again", self.step, exc
                )
                return None
            return [*results, _stamp(ShardStamp(self.rank, cursor, answer.checksum, save))]
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
        """The coordinator writes the metadata, once every rank's shard is committed: it names the
        save and each rank's shard of it (size and checksum), and is stored under that save, so
        the agents drop every other save of the step."""
        assert self.step is not None
        storage: dict[MetadataIndex, ShardRef] = {}
        stamps: list[ShardStamp] = []
        for rank_results in results:
            for result in rank_results:
                if isinstance(result.storage_data, ShardStamp):
                    stamps.append(result.storage_data)
                else:
                    storage[result.index] = result.storage_data
        saves = {stamp.save for stamp in stamps}
        if len(saves) != 1 or len({s.rank for s in stamps}) != len(stamps):
            raise RuntimeError(f"the ranks' shards do not name one save of step {self.step}: {sorted(saves)}")
        world_size = len(stamps)
        if {s.rank for s in stamps} != set(range(world_size)):
            raise RuntimeError(f"the shards of step {self.step} are not of ranks 0..{world_size - 1}")
        save = SaveRecord(saves.pop(), tuple(sorted(stamps, key=lambda s: s.rank)))
        metadata.storage_data = storage
        # The metadata is the namespace's last rank, whatever this job's world size; the ranks
        # between this job's last and the metadata get a placeholder of this save, so the step
        # is complete for the agents (every rank of the namespace held) and on S3 like any other.
        metadata_rank = self._ensure_namespace() - 1
        for rank in range(world_size, metadata_rank):
            self._client.put(self.config.namespace, rank, self.step, UNUSED_RANK, save=save.id)
        self._client.put(
            self.config.namespace,
            metadata_rank,
            self.step,
            codec.encode(metadata, save=save),
            save=save.id,
        )


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


def _copy_into(
    buffer: torch.Tensor,
    offset: int,
    payload: torch.Tensor | memoryview,
    length: int,
    device_copies: DeviceCopies | None = None,
) -> None:
    if not length:
        return
    if isinstance(payload, torch.Tensor):
        dest = buffer[offset : offset + length].view(payload.dtype).view(payload.shape)
        (device_copies or DeviceCopies()).copy(dest, payload)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only record: only read from
            source = torch.frombuffer(payload, dtype=torch.uint8)
        buffer[offset : offset + length].copy_(source)


def _stamp(stamp: ShardStamp) -> WriteResult:
    """The write result that carries a rank's shard as a whole to the coordinator's ``finish``."""
    return WriteResult(
        index=MetadataIndex(f"{SHARD_STAMP_FQN}.{stamp.rank}"), size_in_bytes=stamp.size, storage_data=stamp
    )


def _result(item: WriteItem, rank: int, offset: int, length: int, payload: Any) -> WriteResult:
    if isinstance(payload, torch.Tensor):
        ref = ShardRef(rank, offset, length, codec.dtype_name(payload.dtype), tuple(payload.shape))
    else:
        ref = ShardRef(rank, offset, length)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=ref)
