"""Finding 1 of the security issue: loading a checkpoint never runs code from a tier.

Attacks as an attacker makes them: with nothing but the agent's port (raw HTTP on its ``/v1/cp``
protocol, which carries no credentials) or the S3 bucket (boto3 with any credentials), they plant
a newer step whose shard holds a pickle with a ``__reduce__`` payload in place of a non-tensor
value, with the metadata entry pointing at it and every checksum right, so that only the
decoder stands between the payload and the trainer. And a shard tampered in the agent's shared
memory, whose checksum no longer matches, is never decoded (the fast path included). Each time
the earlier good checkpoint still loads byte for byte, and the load says why it skipped the rest.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.distributed.checkpoint import save

from hyperpod_sim.contracts.shards import checksum_of
from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageWriter, load_latest
from hyperpod_sim.sdk.metadata import VALUE_MAGIC
from tests.conftest import ControlPlane, wait_for
from tests.s3_checkpoints import markers, set_policy
from tests.sdk_worker import same, training_state
from tests.tier import cluster, get, latest, put, replicated, url

pytestmark = [
    pytest.mark.patient_heartbeats,
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

NS = "job"
TARGET = "rank0.extra.step"  # the non-tensor value the attacker replaces (the job's step counter)


@pytest.fixture
def sm(agent_plane: ControlPlane) -> Any:
    return agent_plane.client()


@pytest.fixture
def agent_settings(s3_agent_settings: dict[str, Any]) -> dict[str, Any]:
    """S3: moto behind the test proxy (tests/plugins/s3.py)."""
    return s3_agent_settings


class Payload:
    """What an attacker pickles: unpickling it runs ``touch`` on the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def payloads(marker: Path) -> dict[str, bytes]:
    """The payload as a bare pickle (what ``torch.load(weights_only=False)`` runs at once) and as a
    ``torch.save`` record (what DCP's planner writes for a non-tensor value)."""
    record = io.BytesIO()
    torch.save(Payload(marker), record)
    return {"pickle": pickle.dumps(Payload(marker)), "torch.save": record.getvalue()}


def ref_of(metadata: bytes, fqn: str) -> dict[str, Any]:
    """Where the metadata document says ``fqn``'s bytes are (rank, offset, length)."""
    ref: dict[str, Any] = next(
        e["ref"] for e in json.loads(metadata)["storage_data"] if e["index"]["fqn"] == fqn
    )
    return ref


def retarget(metadata: bytes, payload_at: int, payload: bytes) -> bytes:
    """The metadata document with TARGET's entry pointing at the payload."""
    doc = json.loads(metadata)
    entry = next(e for e in doc["storage_data"] if e["index"]["fqn"] == TARGET)
    entry["ref"].update(offset=payload_at, length=len(payload))
    return json.dumps(doc).encode()


def rebind(metadata: bytes, rank: int, shard: bytes) -> bytes:
    """The metadata document naming ``shard`` as ``rank``'s shard of its save (its size and
    checksum recomputed): what anyone who can write to the agents or S3 can forge."""
    doc = json.loads(metadata)
    entry = next(s for s in doc["save"]["shards"] if s["rank"] == rank)
    entry.update(size=len(shard), checksum=checksum_of(shard))
    return json.dumps(doc).encode()


def with_payload(shard: bytes, payload: bytes) -> tuple[bytes, int]:
    """The shard with the payload appended (64-byte aligned, as the SDK lays values out)."""
    at = -(-len(shard) // 64) * 64
    return shard + b"\0" * (at - len(shard)) + payload, at


def plant_through_agent(agent: str, source: int, step: int, payload: bytes, world: int = 1) -> None:
    """Step ``step``: ``source``'s shards read back through the agent, TARGET replaced by the
    payload, every shard and the metadata POSTed with a correct Shard-Meta checksum."""
    shards = {rank: get(agent, NS, rank, source).content for rank in range(world + 1)}
    rank = ref_of(shards[world], TARGET)["rank"]
    shards[rank], at = with_payload(shards[rank], payload)
    shards[world] = rebind(retarget(shards[world], at, payload), rank, shards[rank])
    for r, data in shards.items():
        assert put(agent, NS, r, step, data).status_code == 200


def trainer(agent: str, **extra: Any) -> TieredCheckpointConfig:
    return TieredCheckpointConfig(namespace=NS, world_size=1, agent_url=agent, **extra)


def state_at(step: int, note: int = 0) -> dict[str, Any]:
    """The trainer's state at ``step`` (tests/sdk_worker.py), with a string of ``note`` bytes."""
    state = training_state(step, 0)
    if note:
        state["note"] = "n" * note
    return state


def checkpoint(config: TieredCheckpointConfig, step: int, note: int = 0) -> None:
    save(state_at(step, note), storage_writer=TieredStorageWriter(config, step=step))


def resume(config: TieredCheckpointConfig, note: int = 0) -> Any:
    state = state_at(987, note)
    loaded = load_latest(state, config)
    assert same(state, state_at(loaded.step, note)), f"step {loaded.step} came back altered"
    return loaded


def test_a_pickle_planted_through_the_agent_protocol_never_runs(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    (agent,) = (url(n) for n in cluster(sm, agent_plane, "planted", 1, instance_type="ml.g5.2xlarge"))
    config = trainer(agent)
    checkpoint(config, 1)
    marker = tmp_path / "pwned"
    for step, payload in zip((2, 3), payloads(marker).values(), strict=True):
        plant_through_agent(agent, 1, step, payload)
    assert latest(agent, NS)[:3] == [3, 2, 1]  # the planted steps are complete and newest

    loaded = resume(config)

    assert not marker.exists()
    assert (loaded.step, loaded.served_by, loaded.rejected) == (1, {0: "memory"}, {})
    # Each planted step was refused for what it is, on every copy tried (this node's shared
    # memory, mapped, then the agent), and named in what load_latest returns.
    assert sorted(loaded.skipped) == [2, 3]
    for step in (2, 3):
        why = loaded.skipped[step]
        assert f"rank 0 of step {step} of 'job': no good copy in any tier" in why, why
        assert f"memory (this node, mapped): {TARGET}: not a JSON value and refused by " in why, why
        assert f"memory: {TARGET}: not a JSON value and refused by torch.load(weights_only=True)" in why
    assert "posix.system" in loaded.skipped[3]  # the torch.save record: its global is refused by name
    assert not marker.exists()


def test_a_pickle_planted_on_s3_never_runs(
    agent_plane: ControlPlane,
    sm: Any,
    tmp_path: Path,
    s3: Any,
    bucket: str,
    moto_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)  # the trainer reads S3 directly too
    (agent,) = (url(n) for n in cluster(sm, agent_plane, "s3planted", 1, instance_type="ml.g5.2xlarge"))
    set_policy(agent_plane, sm, "s3planted", S3BaseUri=f"s3://{bucket}/p", PersistEverySteps=1)
    config = trainer(agent, s3_tier_base_path=f"s3://{bucket}/p")
    checkpoint(config, 1)
    wait_for(lambda: markers(s3, bucket, f"p/{NS}/") == [1], timeout=60, what="step 1 on S3")
    # The attacker writes step 2 straight into the bucket: step 1's objects with the payload in
    # rank 0's shard, the metadata pointing at it, and a commit marker whose checksums match.
    marker = tmp_path / "pwned"
    payload = payloads(marker)["torch.save"]
    commit = json.loads(s3.get_object(Bucket=bucket, Key=f"p/{NS}/_committed/step_1.json")["Body"].read())
    objects = {d["rank"]: s3.get_object(Bucket=bucket, Key=d["key"])["Body"].read() for d in commit["shards"]}
    objects[0], at = with_payload(objects[0], payload)
    objects[1] = rebind(retarget(objects[1], at, payload), 0, objects[0])
    shards = []
    for doc in commit["shards"]:
        key, body = doc["key"].replace("/step_1/", "/step_2/"), objects[doc["rank"]]
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        shards.append({**doc, "key": key, "size": len(body), "checksum": checksum_of(body)})
    forged = {**commit, "step": 2, "shards": shards}
    s3.put_object(Bucket=bucket, Key=f"p/{NS}/_committed/step_2.json", Body=json.dumps(forged).encode())
    wait_for(lambda: latest(agent, NS)[:2] == [2, 1], timeout=30, what="the forged step listed")

    loaded = resume(config)

    assert not marker.exists()
    assert (loaded.step, loaded.served_by, loaded.rejected) == (1, {0: "memory"}, {})
    why = loaded.skipped[2]
    # The agent served the forged shard from S3 (verified against the forged marker), and so did
    # S3 read directly: both copies were refused by the decoder, nothing ran.
    assert f"s3: {TARGET}: not a JSON value and refused by torch.load(weights_only=True)" in why, why
    assert f"s3-direct: {TARGET}: not a JSON value and refused by " in why, why
    assert "posix.system" in why


def test_a_copy_rewritten_through_the_protocol_falls_back_to_a_good_copy(
    agent_plane: ControlPlane,
    sm: Any,
    tmp_path: Path,
    s3: Any,
    bucket: str,
    moto_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    (agent,) = (url(n) for n in cluster(sm, agent_plane, "rewritten", 1, instance_type="ml.g5.2xlarge"))
    set_policy(agent_plane, sm, "rewritten", S3BaseUri=f"s3://{bucket}/r", PersistEverySteps=1)
    config = trainer(agent, s3_tier_base_path=f"s3://{bucket}/r")
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Payload(marker), protocol=0)
    checkpoint(config, 1, note=len(payload) + 64)
    wait_for(lambda: markers(s3, bucket, f"r/{NS}/") == [1], timeout=60, what="step 1 on S3")
    # The attacker overwrites the agent's copy of step 1 in place: the payload (padded to the
    # same length) over the string's record, the metadata untouched, the checksum recomputed.
    ref = ref_of(get(agent, NS, 1, 1).content, "note")
    shard = bytearray(get(agent, NS, 0, 1).content)
    shard[ref["offset"] : ref["offset"] + ref["length"]] = payload.ljust(ref["length"], b" ")
    assert put(agent, NS, 0, 1, bytes(shard)).status_code == 200
    assert get(agent, NS, 0, 1).content == shard

    loaded = resume(config, note=len(payload) + 64)

    assert not marker.exists()
    # The copy in the agent's memory is not the one the step's metadata names (its checksum is
    # another's): refused before a byte of it is decoded. The agent served S3's copy, verified
    # against the commit marker written before the attack (byte for byte: resume checks it).
    assert (loaded.step, loaded.served_by, loaded.skipped) == (1, {0: "s3"}, {})
    (why,) = loaded.rejected[0]
    assert why.startswith("memory (this node, mapped): a copy of another save of the step"), why
    # (A copy that the forged metadata names does reach the decoder, which refuses it: the tests
    # above.)


# -------------------------------------------------------------- checksum before decoding


def touch(path: str) -> str:
    """The canary: allowed by this test (torch.serialization.safe_globals) so that a record calling
    it shows whether the decoder ever saw the bytes."""
    Path(path).touch()
    return "touched"


class Canary:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (touch, (str(self.marker),))


def test_a_shard_whose_checksum_fails_is_never_decoded(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path
) -> None:
    a, _ = (url(n) for n in cluster(sm, agent_plane, "tampered", 2, instance_type="ml.g5.2xlarge"))
    marker = tmp_path / "decoded"
    record = io.BytesIO()
    torch.save(Canary(marker), record)
    canary = record.getvalue()
    # The state holds a string whose record is exactly as long as the canary.
    note = len(canary) - len(VALUE_MAGIC) - 2
    config = trainer(a)
    checkpoint(config, 1, note)
    wait_for(lambda: replicated(a), timeout=30, what="replicas on b")
    # Someone with access to the agent's shared memory writes the canary over the string's
    # record in this node's copy of rank 0: its checksum no longer matches.
    ref = ref_of(get(a, NS, 1, 1).content, "note")
    assert (ref["rank"], ref["length"]) == (0, len(canary))
    where = httpx.get(f"{a}/v1/fast/shards/{NS}/0/1").json()
    with open(where["path"], "r+b") as handle:
        handle.seek(ref["offset"])
        handle.write(canary)

    with torch.serialization.safe_globals([touch]):
        loaded = resume(config, note)  # a trainer that even allows the canary's callable

    assert not marker.exists()  # the tampered bytes never reached the decoder
    assert (loaded.step, loaded.served_by) == (1, {0: "replica"})
    assert loaded.rejected == {0: ["memory (this node, mapped): checksum mismatch"]}

    # Control: the same canary as the value of a step whose checksums are right (planted through
    # the protocol) does reach the decoder, which calls the callable this test allowed: only the
    # checksum stopped it above.
    plant_through_agent(a, 1, 2, canary)
    state = state_at(987, note)
    with torch.serialization.safe_globals([touch]):
        assert load_latest(state, config).step == 2
    assert marker.exists()
    assert state["rank0"]["extra"]["step"] == "touched"


def library_save(agent: str, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real amzn-sagemaker-checkpointing library saves ``state_at(step)`` through the agent
    (its in-memory tier), in this process: its format, a pickled DCP Metadata and torch.save
    records."""
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import SageMakerTieredStorageWriter
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig

    defaults = list(InMemoryClientConfig.__init__.__defaults__ or ())
    defaults[0] = agent  # base_url, as tests/dcp_worker.py points it
    monkeypatch.setattr(InMemoryClientConfig.__init__, "__defaults__", tuple(defaults))
    config = SageMakerCheckpointConfig(namespace=NS, world_size=1)
    save(state_at(step), storage_writer=SageMakerTieredStorageWriter(checkpoint_config=config, step=step))


def test_a_pickle_planted_in_the_library_format_never_runs(
    agent_plane: ControlPlane, sm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library's own format is pickle throughout. A step the library wrote loads (its metadata
    through the allow-list unpickler, its records with weights_only=True); one whose metadata is a
    ``__reduce__`` payload, or whose record of a value is one, is refused and nothing runs."""
    (agent,) = (url(n) for n in cluster(sm, agent_plane, "libplanted", 1, instance_type="ml.g5.2xlarge"))
    config = trainer(agent)
    library_save(agent, 2, monkeypatch)
    marker = tmp_path / "pwned"
    bare, record = payloads(marker)["pickle"], payloads(marker)["torch.save"]
    # Step 3: the library's step 2 with TARGET's record replaced by the payload, the metadata
    # (unpickled here by the attacker, who trusts it) pointing at it; step 4: the metadata itself
    # is the payload.
    shard, metadata = get(agent, NS, 0, 2).content, pickle.loads(get(agent, NS, 1, 2).content)
    index = next(i for i in metadata.storage_data if i.fqn == TARGET)
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(rank=info.rank, offset=len(shard), length=len(record))
    assert put(agent, NS, 0, 3, shard + record).status_code == 200
    assert put(agent, NS, 1, 3, pickle.dumps(metadata)).status_code == 200
    assert put(agent, NS, 0, 4, shard).status_code == 200
    assert put(agent, NS, 1, 4, bare).status_code == 200
    assert latest(agent, NS)[:3] == [4, 3, 2]  # (step 1 left memory: 3 steps are kept)

    loaded = resume(config)

    assert not marker.exists()
    assert loaded.step == 2, loaded  # the library's step, in its format, byte for byte (resume checks)
    assert sorted(loaded.skipped) == [3, 4]
    assert "posix.system, which is not allowed" in loaded.skipped[4], loaded.skipped[4]
    assert f"{TARGET}: refused by torch.load(weights_only=True)" in loaded.skipped[3], loaded.skipped[3]
    assert not marker.exists()
