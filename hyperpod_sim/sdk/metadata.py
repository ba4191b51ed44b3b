"""What a checkpoint holds besides raw tensor bytes, in forms a reader decodes without running code.

PyTorch's own storage layers pickle ``Metadata`` and DCP's default planner ``torch.save``s every
non-tensor value and loads it back with ``torch.load(weights_only=False)``; a checkpoint read back
from shared memory, another node or S3 is not bytes a trainer should unpickle. Two codecs:

- ``encode`` / ``decode``: the DCP metadata as plain JSON, rebuilt into the same dataclasses;
  anything it does not know is refused, not guessed.
- ``encode_value`` / ``decode_value``: a non-tensor state-dict value (a step counter, an
  optimizer's hyperparameters). Plain Python values are JSON with a tagged encoding for what JSON
  lacks (see ``_plain``); a value that is not plain (a tuple of tensors, a type the trainer allowed
  with ``torch.serialization.add_safe_globals``) is a ``torch.save`` record that is decoded only
  with ``torch.load(weights_only=True)``, PyTorch's allow-list unpickler. A value that neither
  form can hold is refused when it is saved, never when it is loaded.
"""

from __future__ import annotations

import base64
import io
import json
import math
import warnings
from collections import OrderedDict
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


@dataclass(frozen=True)
class ShardStamp:
    """What a rank's shard of one save is: its size and checksum (base64 xxh3_128), as the agent
    stored it, and the save it is of."""

    rank: int
    size: int
    checksum: str
    save: str


@dataclass(frozen=True)
class SaveRecord:
    """The save a step's metadata commits: its id and every rank's shard of it. A reader uses only
    shards with these checksums, whichever tier or node serves them."""

    id: str
    shards: tuple[ShardStamp, ...]

    @property
    def world_size(self) -> int:
        """The ranks of the job that saved the step (its shards are ranks 0..world_size-1)."""
        return len(self.shards)

    def checksum_of(self, rank: int) -> str | None:
        return next((s.checksum for s in self.shards if s.rank == rank), None)

    def doc(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "shards": [{"rank": s.rank, "size": s.size, "checksum": s.checksum} for s in self.shards],
        }

    @classmethod
    def from_doc(cls, doc: Any) -> SaveRecord:
        """ValueError unless ``doc`` is a save record ``doc()`` wrote."""
        try:
            save = doc["id"]
            shards = tuple(
                ShardStamp(int(s["rank"]), int(s["size"]), str(s["checksum"]), str(save))
                for s in doc["shards"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the metadata's save record is malformed: {str(exc)[:200]}") from exc
        if not isinstance(save, str) or len({s.rank for s in shards}) != len(shards):
            raise ValueError("the metadata's save record is malformed: a bad id or a rank twice")
        return cls(save, shards)


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


def encode(metadata: Metadata, *, save: SaveRecord | None = None) -> bytes:
    """Metadata as UTF-8 JSON, with the save it commits; TypeError for anything this codec does
    not represent."""
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
        "save": None if save is None else save.doc(),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_save(data: bytes | bytearray | memoryview) -> SaveRecord | None:
    """The save that metadata ``encode`` wrote commits; None if it names none (metadata of an
    earlier version: not a committed save); ValueError if it is not hyperpod-sim's metadata."""
    try:
        doc = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"the checkpoint metadata is malformed: {str(exc)[:300]}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not hyperpod-sim DCP metadata")
    save = doc.get("save")
    return None if save is None else SaveRecord.from_doc(save)


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
    except (KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"the checkpoint metadata is malformed: {str(exc)[:300]}") from exc


# ---------------------------------------------------------------------------- non-tensor values

VALUE_MAGIC = b"hpsim-json-value/1\n"  # what a JSON value record starts with; anything else is torch.save
_MAX_DEPTH = 200  # values nest far less; deeper JSON is refused rather than recursed into


class NotPlain(TypeError):
    """A value the JSON form cannot hold."""


class UndecodableValue(ValueError):
    """A value record that none of the decoders accepts (tampered, truncated, or not ours)."""


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON. Exact types only, so a value loads back as the same type: ``None``,
    ``bool``, ``int``, ``str`` and finite ``float`` as themselves, ``list`` as an array; everything
    else as an object with exactly one tag: ``{"float": "nan"|"inf"|"-inf"}``, ``{"tuple": [...]}``,
    ``{"dict": [[key, value], ...]}`` (keys of any plain type, order kept), ``{"odict": ...}``
    (``OrderedDict``), ``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": base64}``,
    ``{"complex": [re, im]}``, ``{"dtype": "float32"}``, ``{"size": [...]}`` (``torch.Size``),
    ``{"device": "cuda:0"}``, and NumPy arrays and scalars of numeric dtypes (``{"ndarray": [dtype,
    shape, base64]}``, ``{"numpy": [dtype, base64]}``), as in a NumPy RNG state."""
    if depth > _MAX_DEPTH:
        raise NotPlain("nested too deep")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [_plain(v, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [_plain(v, depth + 1) for v in value]}
    if kind is dict or kind is OrderedDict:
        tag = "dict" if kind is dict else "odict"
        return {tag: [[_plain(k, depth + 1), _plain(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {kind.__name__: [_plain(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if kind is complex:
        return {"complex": [_plain(value.real), _plain(value.imag)]}
    if kind is torch.dtype:
        return {"dtype": dtype_name(value)}
    if kind is torch.Size:
        return {"size": [int(v) for v in value]}
    if kind is torch.device:
        return {"device": str(value)}
    if kind.__module__ == "numpy":  # an array or a scalar of a numeric dtype (a NumPy RNG state)
        import numpy as np

        array = np.asarray(value)
        if isinstance(value, np.ndarray | np.generic) and _numeric(array.dtype):
            data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
            if isinstance(value, np.ndarray):
                return {"ndarray": [array.dtype.str, list(array.shape), data]}
            return {"numpy": [array.dtype.str, data]}
    raise NotPlain(f"{kind.__module__}.{kind.__qualname__}")


def _numeric(dtype: Any) -> bool:
    """A NumPy dtype of plain numbers (no objects, no fields): what ``_unplain`` rebuilds."""
    return bool(dtype.kind in "biufc" and not dtype.hasobject and dtype.fields is None)


def _numpy(tag: str, body: list[Any]) -> Any:
    """A NumPy array or scalar from its dtype string and bytes; only numeric dtypes."""
    try:
        import numpy as np
    except ImportError as exc:
        raise UndecodableValue("a NumPy value, and NumPy is not installed") from exc
    dtype = np.dtype(body[0]) if type(body[0]) is str else None
    if dtype is None or not _numeric(dtype) or type(body[-1]) is not str:
        raise UndecodableValue(f"not a numeric NumPy value: {str(body)[:80]}")
    data = base64.b64decode(body[-1], validate=True)
    if tag == "numpy":
        if len(data) != dtype.itemsize:
            raise UndecodableValue("a NumPy scalar of the wrong size")
        return np.frombuffer(data, dtype=dtype)[0]
    shape = body[1]
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise UndecodableValue("a NumPy array without a shape")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _unplain(doc: Any, depth: int = 0) -> Any:
    """The value ``_plain`` wrote; UndecodableValue for anything else."""
    if depth > _MAX_DEPTH:
        raise UndecodableValue("nested too deep")
    if doc is None or type(doc) in (bool, int, float, str):
        return doc
    if type(doc) is list:
        return [_unplain(v, depth + 1) for v in doc]
    if type(doc) is not dict or len(doc) != 1:
        raise UndecodableValue(f"not a tagged value: {str(doc)[:80]}")
    ((tag, body),) = doc.items()
    items = body if type(body) is list else None
    if tag == "float" and body in _FLOATS:
        return _FLOATS[body]
    if tag == "tuple" and items is not None:
        return tuple(_unplain(v, depth + 1) for v in items)
    if tag in ("dict", "odict") and items is not None:
        pairs = []
        for pair in items:
            if type(pair) is not list or len(pair) != 2:
                raise UndecodableValue(f"a {tag} entry is not a [key, value] pair")
            pairs.append((_unplain(pair[0], depth + 1), _unplain(pair[1], depth + 1)))
        return dict(pairs) if tag == "dict" else OrderedDict(pairs)
    if tag in ("set", "frozenset") and items is not None:
        members = (_unplain(v, depth + 1) for v in items)
        return set(members) if tag == "set" else frozenset(members)
    if tag == "bytes" and type(body) is str:
        return base64.b64decode(body, validate=True)
    if tag == "complex" and items is not None and len(items) == 2:
        real, imag = (_unplain(v, depth + 1) for v in items)
        if type(real) is not float or type(imag) is not float:
            raise UndecodableValue("a complex number's parts are not floats")
        return complex(real, imag)
    if tag == "dtype" and type(body) is str:
        try:
            return dtype_of(body)
        except ValueError as exc:
            raise UndecodableValue(str(exc)) from exc
    if tag == "size" and items is not None and all(type(v) is int for v in items):
        return torch.Size(items)
    if tag == "device" and type(body) is str:
        return torch.device(body)
    if (tag, len(items or ())) in (("ndarray", 3), ("numpy", 2)):
        return _numpy(tag, body)
    raise UndecodableValue(f"unknown or malformed tag {tag!r}")


def encode_value(value: Any, *, fqn: str = "?") -> bytes:
    """A non-tensor state-dict value as a record ``decode_value`` reads: JSON when the value is
    plain, else ``torch.save`` bytes, which must load back with ``weights_only=True`` here and now
    (so a value a reader would refuse is refused at save time instead). TypeError otherwise."""
    try:
        return VALUE_MAGIC + json.dumps(_plain(value), separators=(",", ":"), allow_nan=False).encode()
    except NotPlain:
        pass
    stream = io.BytesIO()
    torch.save(value, stream)
    record = stream.getvalue()
    try:
        torch.load(io.BytesIO(record), weights_only=True)
    except Exception as exc:
        raise TypeError(
            f"the state dict's value {fqn!r} ({type(value).__module__}.{type(value).__qualname__}) cannot "
            "be checkpointed: non-tensor values are stored as JSON (None, bool, int, float, str, bytes, "
            "complex, list, tuple, dict, set, torch dtypes, sizes and devices, numeric NumPy arrays and "
            "scalars) or as torch.save records "
            "that load with torch.load(weights_only=True); convert it to such values, or allow its type "
            f"with torch.serialization.add_safe_globals on the saving and the loading side ({exc})"
        ) from exc
    return record


def decode_value(data: bytes | bytearray | memoryview) -> Any:
    """The value of a record ``encode_value`` wrote, decoded without running code from it: JSON,
    or ``torch.load(weights_only=True)`` (PyTorch's allow-list unpickler) for anything else.
    UndecodableValue when neither accepts it."""
    raw = bytes(data)
    if raw.startswith(VALUE_MAGIC):
        try:
            return _unplain(json.loads(raw[len(VALUE_MAGIC) :]))
        except UndecodableValue:
            raise
        except Exception as exc:  # JSONDecodeError, RecursionError, an unhashable key, a bad device
            raise UndecodableValue(f"malformed JSON value: {str(exc)[:300]}") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # about the pickle protocol of a foreign record
            return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # UnpicklingError for a disallowed global, RuntimeError, EOFError, ...
        raise UndecodableValue(
            f"not a JSON value and refused by torch.load(weights_only=True): {_gist(exc)}"
        ) from exc


def _gist(exc: Exception) -> str:
    """What a torch.load error says was refused, without its page of advice."""
    boilerplate = ("Weights only load failed", "Check the documentation", "(1)", "(2)", "Re-running")
    parts = []
    for line in str(exc).splitlines():
        line = line.strip().rpartition("WeightsUnpickler error:")[2].strip()
        if line and not line.startswith(boilerplate):
            parts.append(line)
    return " ".join(parts)[:300] or type(exc).__name__
