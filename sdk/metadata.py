"""DCP checkpoint metadata as JSON: what a reader loads without unpickling anything.

PyTorch's own storage layers pickle ``Metadata``; a checkpoint read back from shared memory, another
node or S3 is not bytes a trainer should unpickle. This codec writes every field DCP needs as plain
JSON and rebuilds the same dataclasses; anything it does not know is refused, not guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

FORMAT = "hyperpod-sim/dcp-metadata"
VERSION = 1


@dataclass(frozen=True)
class ShardRef:
    """Where one write item's bytes are: rank's shard of the step, at ``offset`` for ``length``
    bytes; for tensors, also the dtype and shape the bytes hold (raw, C order)."""

    rank: int
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}


def _index(index: MetadataIndex) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
    }


def _index_from(doc: dict[str, Any]) -> MetadataIndex:
    offset = doc.get("offset")
    return MetadataIndex(
        str(doc["fqn"]), None if offset is None else [int(o) for o in offset], doc.get("index")
    )


def _storage(item: Any) -> dict[str, Any]:
    if isinstance(item, BytesStorageMetadata):
        return {"kind": "bytes"}
    if isinstance(item, TensorStorageMetadata):
        props = item.properties
        return {
            "kind": "tensor",
            "dtype": dtype_name(props.dtype),
            "layout": str(props.layout).removeprefix("torch."),
            "requires_grad": props.requires_grad,
            "memory_format": str(props.memory_format).removeprefix("torch."),
            "pin_memory": props.pin_memory,
            "size": list(item.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
        }
    raise TypeError(f"cannot encode storage metadata of type {type(item).__name__}")


def _storage_from(doc: dict[str, Any]) -> TensorStorageMetadata | BytesStorageMetadata:
    if doc["kind"] == "bytes":
        return BytesStorageMetadata()
    if doc["kind"] != "tensor":
        raise ValueError(f"unknown storage kind {doc['kind']!r}")
    return TensorStorageMetadata(
        properties=TensorProperties(
            dtype=dtype_of(doc["dtype"]),
            layout=_LAYOUTS[doc["layout"]],
            requires_grad=bool(doc["requires_grad"]),
            memory_format=_FORMATS[doc["memory_format"]],
            pin_memory=bool(doc["pin_memory"]),
        ),
        size=torch.Size(doc["size"]),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
            for c in doc["chunks"]
        ],
    )


def _ref(ref: Any) -> dict[str, Any]:
    if not isinstance(ref, ShardRef):
        raise TypeError(f"storage data must be ShardRef, got {type(ref).__name__}")
    return {
        "rank": ref.rank,
        "offset": ref.offset,
        "length": ref.length,
        "dtype": ref.dtype,
        "shape": None if ref.shape is None else list(ref.shape),
    }


def _ref_from(doc: dict[str, Any]) -> ShardRef:
    shape = doc.get("shape")
    return ShardRef(
        int(doc["rank"]),
        int(doc["offset"]),
        int(doc["length"]),
        doc.get("dtype"),
        None if shape is None else tuple(int(s) for s in shape),
    )


def _path(path: Any) -> list[Any]:
    """A planner object path (a tuple of str and int keys)."""
    if not isinstance(path, tuple | list) or not all(isinstance(p, str | int) for p in path):
        raise TypeError(f"planner data must map to tuples of str/int keys, got {path!r}")
    return list(path)


def encode(metadata: Metadata) -> bytes:
    """Metadata as UTF-8 JSON; TypeError for anything this codec does not represent."""
    planner = metadata.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise TypeError(f"planner data of type {type(planner).__name__} is not supported")
    meta = metadata.storage_meta
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": metadata.version,
        "state_dict_metadata": {fqn: _storage(item) for fqn, item in metadata.state_dict_metadata.items()},
        "planner_data": None if planner is None else {k: _path(v) for k, v in planner.items()},
        "storage_data": [
            {"index": _index(index), "ref": _ref(ref)} for index, ref in (metadata.storage_data or {}).items()
        ],
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes | bytearray | memoryview) -> Metadata:
    """The Metadata ``encode`` wrote; ValueError for anything else."""
    try:
        doc = json.loads(bytes(data))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not hyperpod-sim DCP metadata")
        if doc.get("version") != VERSION:
            raise ValueError(f"metadata version {doc.get('version')!r} is not {VERSION}")
        planner = doc.get("planner_data")
        meta = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata={
                fqn: _storage_from(item) for fqn, item in doc["state_dict_metadata"].items()
            },
            planner_data=None if planner is None else {k: tuple(v) for k, v in planner.items()},
            storage_data={_index_from(e["index"]): _ref_from(e["ref"]) for e in doc["storage_data"]},
            storage_meta=None
            if meta is None
            else StorageMeta(
                checkpoint_id=meta["checkpoint_id"],
                save_id=meta["save_id"],
                load_id=meta["load_id"],
                modules=list(meta.get("modules", [])),
            ),
            version=doc.get("dcp_version"),
        )
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the checkpoint metadata is malformed: {exc}") from exc
