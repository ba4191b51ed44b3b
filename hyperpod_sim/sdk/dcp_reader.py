"""The DCP storage reader of a tiered checkpoint (``hyperpod_sim/sdk/checkpoint.py`` has the overview).

DCP calls it in the order ``torch/distributed/checkpoint/storage.py`` documents: ``reset``,
``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan``,
``read_data`` (a Future). Every copy's checksum is verified before a byte of it is decoded.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from hyperpod_sim.contracts.shards import Checksum, checksum_of
from hyperpod_sim.sdk import library_format
from hyperpod_sim.sdk import metadata as codec
from hyperpod_sim.sdk.agent import AgentError
from hyperpod_sim.sdk.checkpoint_config import (
    CheckpointNotFound,
    IntegrityError,
    StepCheckpointIds,
    TieredCheckpointConfig,
)
from hyperpod_sim.sdk.library_format import LibraryRef
from hyperpod_sim.sdk.metadata import SaveRecord, ShardRef, UndecodableValue
from hyperpod_sim.sdk.s3direct import read_shard

log = logging.getLogger(__name__)


class TieredStorageReader(StepCheckpointIds, StorageReader):
    """DCP storage reader (``SageMakerTieredStorageReader``'s counterpart): a given step, or the
    newest complete one. ``served_by`` tells, per rank shard read, which tier served it;
    ``rejected``, per rank, every copy not used and why (``"memory: checksum mismatch"``)."""

    def __init__(self, checkpoint_config: TieredCheckpointConfig, step: int | None = None) -> None:
        super().__init__()
        self.config = checkpoint_config
        self.step = step
        self._client = checkpoint_config.client()
        self.storage_data: dict[MetadataIndex, ShardRef | LibraryRef] = {}
        self.served_by: dict[int, str] = {}
        self.rejected: dict[int, list[str]] = {}
        self.failure: str | None = None  # why the last read failed
        # The save the step's metadata commits (None: the library's metadata, which names none):
        # only its shards are used, by checksum, from whichever tier serves them.
        self.save: SaveRecord | None = None
        # The world size of the job that saved the step read (known once its metadata is read):
        # another than this job's, and the step loads resharded (DCP's planner maps the saved
        # chunks onto this job's sharding; each rank reads only the saved shards it needs).
        self.saved_world_size: int | None = None
        self._namespace_ranks: int | None = None
        # Bytes of saved shards this rank read (fetched, or mapped and verified) and bytes it
        # needed of them (copied into its tensors, and its values' records): a resharded load
        # reads only the saved ranks whose chunks overlap this rank's.
        self.bytes_read = 0
        self.bytes_needed = 0

    def namespace_ranks(self) -> int:
        """The namespace's ranks (the metadata is the last), as its agent says; this job's world
        size + 1 when the agent cannot say (then only a step of this world size is found)."""
        if self._namespace_ranks is None:
            try:
                answer = self._client.namespace(self.config.namespace)
            except AgentError as exc:
                log.warning("the agent did not say the ranks of %r: %s", self.config.namespace, exc)
                answer = None
            self._namespace_ranks = answer.num_ranks if answer is not None else self.config.world_size + 1
        return self._namespace_ranks

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        candidates = (
            [self.step] if self.step is not None else self._client.latest(self.config.namespace, limit=10)
        )
        problems = []
        rank = self.namespace_ranks() - 1
        for step in candidates:
            for data, tier in self._copies(rank, step, local=True):
                try:
                    metadata, save = decode_metadata_and_save(data)
                except ValueError as exc:
                    self._reject(rank, step, tier, str(exc))
                    continue
                self.step = step
                self.save = save
                self.saved_world_size = save.world_size if save is not None else rank
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
        library = any(isinstance(self.storage_data[item.storage_index], LibraryRef) for item in items)
        expected = None
        if self.save is not None:
            expected = self.save.checksum_of(rank)
            if expected is None:
                raise CheckpointNotFound(
                    f"rank {rank} of step {step} of {self.config.namespace!r}: the step's metadata "
                    f"(save {self.save.id}) names no shard of this rank"
                )
        local = None if library else self._read_local(rank, step)
        if local is not None and expected is not None and local.checksum != expected:
            self._reject(rank, step, f"{local.tier} (this node, mapped)", self._other_save(local.checksum))
            with contextlib.suppress(BufferError):
                local.view.release()
            local.release()
            local = None
        if local is not None:
            where = f"{local.tier} (this node, mapped)"
            try:
                self.bytes_read += len(local.view)
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
        for data, tier in self._copies(rank, step, local=False, checksum=expected):
            try:
                self.bytes_read += len(data)
                self._apply(items, data, planner)
            except IntegrityError as exc:
                self._reject(rank, step, tier, str(exc))
                continue
            self._served(rank, tier)
            return
        raise CheckpointNotFound(self._no_copy(rank, step))

    def _read_local(self, rank: int, step: int) -> Any:
        """This node's mapped copy (``AgentClient.read_local``), or None; an agent that does not
        answer is recorded and skipped, so the other tiers (S3 directly) still serve."""
        try:
            return self._client.read_local(self.config.namespace, rank, step)
        except AgentError as exc:
            self._reject(rank, step, "agent (this node)", str(exc), integrity=False)
            return None

    def _other_save(self, checksum: str) -> str:
        save = self.save.id if self.save is not None else "?"
        return f"a copy of another save of the step (checksum {checksum}; the metadata commits save {save})"

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
        if any(isinstance(self.storage_data[item.storage_index], LibraryRef) for item in items):
            _apply_library(items, data, planner, self.storage_data)
            return
        for item in items:
            ref = self.storage_data[item.storage_index]
            assert isinstance(ref, ShardRef)
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
            assert isinstance(ref, ShardRef)
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
            self.bytes_needed += target.numel() * target.element_size()
            planner.commit_tensor(item, target)
            del src
        del source
        for item, value in values:
            _assign(planner, item, value)
        self.bytes_needed += sum(length for _, length in spans)

    def _copies(
        self, rank: int, step: int, *, local: bool, checksum: str | None = None
    ) -> Iterator[tuple[bytes, str]]:
        """A rank's shard of a step, copy after copy, each in this process's memory and verified
        against its checksum (a copy that is not is recorded in ``rejected`` and skipped): this
        node's shared memory (``local``), the agent (which tries its own copy, the other agents'
        and replicas, then S3), then S3 directly (with ``s3_tier_base_path``). ``checksum``: only
        copies with that checksum (the committed metadata's), from every tier."""
        if local:
            found = self._read_local(rank, step)
            if found is not None:
                try:
                    data = bytes(found.view)
                finally:
                    with contextlib.suppress(BufferError):
                        found.view.release()
                    found.release()
                if checksum_of(data) != found.checksum:
                    self._reject(rank, step, f"{found.tier} (this node, mapped)", "checksum mismatch")
                elif checksum is not None and found.checksum != checksum:
                    self._reject(
                        rank, step, f"{found.tier} (this node, mapped)", self._other_save(found.checksum)
                    )
                else:
                    yield data, found.tier
        try:
            remote = self._client.get(self.config.namespace, rank, step, checksum=checksum)
        except AgentError as exc:  # refused, unreachable, or a copy that arrived corrupted
            self._reject(rank, step, "agent", str(exc), integrity="corrupted" in str(exc))
            remote = None
        if remote is not None:
            yield remote
        if self.config.s3_tier_base_path:
            try:
                direct = read_shard(
                    self.config.s3_tier_base_path,
                    self.config.namespace,
                    rank,
                    step,
                    world_size=self.namespace_ranks() - 1,
                    checksum=checksum,
                )
            except Exception as exc:  # S3 unreachable, a marker that is not one, ...
                why = f"{type(exc).__name__}: {str(exc)[:300]}"
                self._reject(rank, step, "s3-direct", why, integrity=False)
                direct = None
            if direct is not None:
                yield direct, "s3-direct"


def decode_metadata(data: bytes) -> Metadata:
    """A step's metadata: hyperpod-sim's JSON, or the library's pickle through its allow-list
    unpickler (``sdk/library_format.py``); ValueError if neither."""
    return decode_metadata_and_save(data)[0]


def decode_metadata_and_save(data: bytes) -> tuple[Metadata, SaveRecord | None]:
    """A step's metadata and the save it commits: hyperpod-sim's JSON, which must name its save
    (metadata that names none commits nothing: ValueError), or the library's pickle through its
    allow-list unpickler (``sdk/library_format.py``), whose protocol names no save (None);
    ValueError if neither."""
    if library_format.is_library_metadata(data):
        return library_format.decode_metadata(data), None
    metadata = codec.decode(data)
    save = codec.decode_save(data)
    if save is None:
        raise ValueError("the metadata names no save (its step's shards are bound to none): not loaded")
    return metadata, save


def _apply_library(
    items: list[Any], data: Any, planner: LoadPlanner, storage: dict[MetadataIndex, Any]
) -> None:
    """Load ``items`` from one copy of a shard the library wrote: every record (a ``torch.save``
    of a tensor or a value) decoded with ``torch.load(weights_only=True)``, all of them before
    anything is assigned; IntegrityError if one lies outside the shard or is refused."""
    view = memoryview(data)
    decoded: list[tuple[Any, Any]] = []
    for item in items:
        ref = storage[item.storage_index]
        fqn = item.storage_index.fqn
        if not isinstance(ref, LibraryRef):
            raise IntegrityError(f"{fqn}: the metadata mixes the library's format with another")
        if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > len(view):
            raise IntegrityError(
                f"{fqn}: bytes {ref.offset}..{ref.offset + ref.length} lie outside the {len(view)}-byte shard"
            )
        try:
            value = library_format.load_record(view[ref.offset : ref.offset + ref.length])
        except library_format.UndecodableLibraryData as exc:
            raise IntegrityError(f"{fqn}: {exc}") from exc
        if item.type != LoadItemType.BYTE_IO:
            if not isinstance(value, torch.Tensor):
                raise IntegrityError(f"{fqn}: the record is a {type(value).__name__}, not a tensor")
            value = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
        decoded.append((item, value))
    for item, value in decoded:
        if item.type == LoadItemType.BYTE_IO:
            _assign(planner, item, value)
            continue
        target = planner.resolve_tensor(item).detach()
        if target.size() != value.size():
            fqn = item.storage_index.fqn
            raise ValueError(f"{fqn}: stored {tuple(value.size())}, wanted {tuple(target.size())}")
        target.copy_(value)
        planner.commit_tensor(item, target)


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
    digest = Checksum()
    copies: list[tuple[int, bytes]] = []
    position = 0
    for start, stop in merged:
        digest.update(view[position:start])
        copy = bytes(view[start:stop])
        digest.update(copy)
        copies.append((start, copy))
        position = stop
    digest.update(view[position:])
    if digest.text() != expected:
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
