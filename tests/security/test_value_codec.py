"""The codec of non-tensor state-dict values (sdk/metadata.py): every plain value comes back as the
same value of the same type without pickle; what JSON cannot hold goes through PyTorch's allow-list
unpickler only; what neither can hold is refused when it is saved, with a message that says how to
fix it; and malformed records are refused, never guessed at."""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import load, save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageReader, TieredStorageWriter
from hyperpod_sim.sdk.metadata import VALUE_MAGIC, UndecodableValue, decode_value, encode_value
from tests.security.fake_agent import FakeAgent

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

PLAIN = [
    None, True, False, 0, -7, 2**80, 0.1, -0.0, math.inf, -math.inf, "", "naïve ☃", b"\x00\xff",
    3 - 4j, [], [1, [2.5, None]], (), (0.9, 0.999), {"lr": 0.1, 3: "x", (1, 2): [None], None: {}},
    OrderedDict([("b", 1), ("a", 2)]), {1, 2}, frozenset({"x"}), torch.bfloat16, torch.Size([2, 3]),
    torch.device("cpu"), np.float32(1.25), np.arange(6, dtype=np.int16).reshape(2, 3), np.random.get_state(),
]  # fmt: skip


def equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b) and repr(a) == repr(b)  # -0.0 stays -0.0


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_are_json_and_come_back_exactly(value: Any) -> None:
    record = encode_value(value)
    assert record.startswith(VALUE_MAGIC)
    assert equal(decode_value(record), value)


def test_nan_and_tensors_inside_a_tuple() -> None:
    assert math.isnan(decode_value(encode_value(math.nan)))
    # A tuple holding a tensor is one value to DCP: a torch.save record, allow-listed types only.
    value = (torch.arange(4.0), 3)
    record = encode_value(value)
    assert not record.startswith(VALUE_MAGIC)
    assert equal(decode_value(record), value)


class Custom:
    pass


def test_a_value_no_decoder_accepts_is_refused_when_saved() -> None:
    refused = r"'extra\.obj' \(.*Custom\) cannot be checkpointed"
    state = {"w": torch.ones(2), "extra": {"obj": Custom()}}
    with FakeAgent() as fake:
        writer = TieredStorageWriter(TieredCheckpointConfig("job", 1, agent_url=fake.url), step=1)
        with pytest.raises((TypeError, CheckpointException), match=refused):
            save(state, storage_writer=writer)
    assert not fake.shards  # nothing was stored
    message = ""
    try:
        encode_value(Custom(), fqn="extra.obj")
    except TypeError as exc:
        message = str(exc)
    assert "torch.serialization.add_safe_globals" in message
    # Allowed by the trainer (on both sides), it is a torch.save record the allow-list decodes.
    with torch.serialization.safe_globals([Custom]):
        assert type(decode_value(encode_value(Custom()))) is Custom
    with pytest.raises(UndecodableValue, match="Custom"):
        decode_value(record_of(Custom()))  # and not allowed, it is refused


def record_of(value: Any) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "record",
    [
        b"",
        b"garbage",
        VALUE_MAGIC + b"{",
        VALUE_MAGIC + b'{"tuple": [1], "dict": []}',
        VALUE_MAGIC + b'{"lambda": "x"}',
        VALUE_MAGIC + b'{"dict": [[[1], 2]]}',  # an unhashable key
        VALUE_MAGIC + b'{"device": "nowhere"}',
        VALUE_MAGIC + b'{"dtype": "Tensor"}',
        VALUE_MAGIC + b'{"bytes": "not base64!"}',
        VALUE_MAGIC + b'{"ndarray": ["O", [1], "AA=="]}',  # object arrays are pickles
        VALUE_MAGIC + b"[" * 100_000 + b"]" * 100_000,
        VALUE_MAGIC + b'{"tuple":' * 300 + b"[]" + b"}" * 300,
    ],
    ids=lambda r: repr(r[len(VALUE_MAGIC) : len(VALUE_MAGIC) + 24]),
)
def test_malformed_records_are_refused(record: bytes) -> None:
    with pytest.raises(UndecodableValue):
        decode_value(record)


def test_pickles_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickles = [pickle.dumps(Payload(marker), protocol=p) for p in (0, 2, 5)]
    for record in [*pickles, record_of(Payload(marker))]:
        with pytest.raises(UndecodableValue, match=re.escape("refused by torch.load(weights_only=True)")):
            decode_value(record)
    assert not marker.exists()


class UnpicklingPlanner(DefaultLoadPlanner):
    """A planner that hands value bytes to torch.load(weights_only=False), as DCP's own once did."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise AssertionError("never called: the reader refuses such a planner before reading")


def test_a_planner_that_would_unpickle_values_is_refused() -> None:
    with FakeAgent() as fake:
        config = TieredCheckpointConfig("job", 1, agent_url=fake.url, fast_path=False)
        save({"w": torch.ones(2), "step": 4}, storage_writer=TieredStorageWriter(config, step=1))
        state: dict[str, Any] = {"w": torch.zeros(2), "step": 0}
        with pytest.raises((TypeError, CheckpointException), match="UnpicklingPlanner overrides load_bytes"):
            load(state, storage_reader=TieredStorageReader(config, step=1), planner=UnpicklingPlanner())
        load(state, storage_reader=TieredStorageReader(config, step=1))  # DCP's default planner
    assert state["step"] == 4
    assert torch.equal(state["w"], torch.ones(2))
