"""The shard and metadata format of the ``amzn-sagemaker-checkpointing`` library, decoded with
allow-lists only (docs/security.md: nothing a tier hands back is unpickled freely).

The library's writer puts, per rank, every item one after another into one buffer: a tensor as its
own ``torch.save`` record, a non-tensor value as the bytes DCP's planner made of it (a
``torch.save`` record too). Its metadata is DCP's ``Metadata`` pickled whole, with
``storage_data`` mapping each ``MetadataIndex`` to the library's ``_SageMakerStorageInfo(rank,
offset, length)``. Here:

- the metadata is read by ``MetadataUnpickler``, which resolves only DCP's metadata dataclasses,
  ``torch.Size``, dtypes, layouts and memory formats, and maps ``_SageMakerStorageInfo`` to
  ``LibraryRef`` (so the library need not be installed); any other global, a ``__reduce__``
  payload's ``os.system`` included, raises ``UndecodableLibraryData`` before anything is called;
- every record of a shard is loaded with ``torch.load(weights_only=True)`` (PyTorch's own
  allow-list unpickler), never with ``weights_only=False`` as the library's reader does.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

_PICKLE_PROTOCOL_2_OR_LATER = b"\x80"
_LIBRARY_STORAGE_INFO = (
    "amzn_sagemaker_checkpointing.checkpointing.filesystem.storage_info",
    "_SageMakerStorageInfo",
)
_DCP_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


class UndecodableLibraryData(ValueError):
    """Bytes that are not the library's format, or that name something off the allow-list."""


@dataclass
class LibraryRef:
    """Where one item lies in a rank's shard (the library's ``_SageMakerStorageInfo``)."""

    rank: int
    offset: int
    length: int


class MetadataUnpickler(pickle.Unpickler):
    """Resolves the globals of a pickled DCP ``Metadata`` and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _LIBRARY_STORAGE_INFO:
            return LibraryRef
        if module == "torch.distributed.checkpoint.metadata" and name in _DCP_CLASSES:
            return getattr(dcp_metadata, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        raise UndecodableLibraryData(f"the metadata names {module}.{name}, which is not allowed")


def is_library_metadata(data: bytes | bytearray | memoryview) -> bool:
    """Whether metadata bytes are the library's (a pickle) rather than hyperpod-sim's (JSON)."""
    return bytes(memoryview(data)[:1]) == _PICKLE_PROTOCOL_2_OR_LATER


def decode_metadata(data: bytes | bytearray | memoryview) -> Metadata:
    """The library's pickled ``Metadata``, through ``MetadataUnpickler``; UndecodableLibraryData
    if it is not one or names anything off the allow-list."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(bytes(data))).load()
    except UndecodableLibraryData:
        raise
    except Exception as exc:  # truncated, or a constructor refusing its arguments
        raise UndecodableLibraryData(f"not the library's metadata: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise UndecodableLibraryData(f"the metadata is a {type(metadata).__name__}, not DCP's Metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(
        isinstance(ref, LibraryRef) and all(type(v) is int for v in (ref.rank, ref.offset, ref.length))
        for ref in storage.values()
    ):
        raise UndecodableLibraryData("the metadata's storage_data is not the library's")
    return metadata


def load_record(data: bytes | bytearray | memoryview) -> Any:
    """One ``torch.save`` record of a library shard (a tensor or a value), with
    ``weights_only=True``; UndecodableLibraryData if PyTorch's allow-list refuses it."""
    try:
        return torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError for a refused global, RuntimeError for junk
        raise UndecodableLibraryData(
            f"refused by torch.load(weights_only=True): {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
