"""Finding 5 of the security issue: the SDK maps only what lies where it expects it.

A fake agent (a real HTTP server on loopback, tests/security/fake_agent.py) answers the SDK's
fast-path calls with a file of its choosing: one outside the shared-memory root, a symbolic link
in the root that points out of it, a linked directory, a ``..`` path, a second hard link to a file,
a file of another size, a FIFO. The SDK writes into none of them (the file is unchanged, and the
save goes over HTTP with a warning saying why), and reads from none of them (what loads is what the
agent served over HTTP). The controls, a plain file of the right size under the root, show that
the same answers are mapped when they are what the SDK expects, so each refusal is the check's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint import save
from torch.distributed.checkpoint.state_dict_saver import async_save

from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageWriter, load_latest
from tests.conftest import shm_root_for
from tests.sdk_worker import same, training_state
from tests.security.fake_agent import FakeAgent

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ATTACKS = ["outside-the-root", "symlink", "symlinked-directory", "dot-dot", "hard-link", "other-size", "fifo"]


@pytest.fixture
def fake() -> Iterator[FakeAgent]:
    with FakeAgent() as agent:
        yield agent


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The shared-memory root the trainer is configured with (removed after the test)."""
    path = shm_root_for(tmp_path)
    (path / "node").mkdir(parents=True)
    return path


def plant(case: str, root: Path, tmp_path: Path, data: bytes) -> tuple[str, Path]:
    """A file holding ``data`` where ``case`` puts it, and the path the fake agent answers."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    victim = outside / "victim"
    answer = root / "node" / "shard"
    match case:
        case "outside-the-root":
            answer = victim
        case "symlink":
            answer.symlink_to(victim)
        case "symlinked-directory":
            (root / "linked").symlink_to(outside, target_is_directory=True)
            answer = root / "linked" / "victim"
        case "dot-dot":
            return f"{root}/node/{os.path.relpath(victim, root / 'node')}", write(victim, data)
        case "hard-link":
            victim = root / "other-file"
            write(victim, data)
            os.link(victim, answer)
        case "other-size":
            victim = answer
            data += b"\0" * 4096
        case "fifo":
            os.mkfifo(answer)
            return str(answer), answer
        case "the-reserved-file" | "the-agents-copy":
            victim = answer
    return str(answer), write(victim, data)


def write(path: Path, data: bytes) -> Path:
    if not path.exists():
        path.write_bytes(data)
    return path


def config(fake: FakeAgent, root: Path, namespace: str = "job", **extra: bool) -> TieredCheckpointConfig:
    return TieredCheckpointConfig(
        namespace=namespace, world_size=1, agent_url=fake.url, shm_root=str(root), **extra
    )


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("case", [*ATTACKS, "the-reserved-file"])
def test_a_reservation_naming_a_foreign_file_is_never_written(
    fake: FakeAgent, root: Path, tmp_path: Path, case: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    planted: dict[str, tuple[Path, bytes]] = {}

    def reserve_path(size: int) -> str:
        content = os.urandom(size)
        answer, victim = plant(case, root, tmp_path, content)
        # The save's own reservation; the one the SDK makes ahead after a commit names the same
        # file again and is not written into.
        planted.setdefault("victim", (victim, victim.read_bytes() if victim.is_file() else b""))
        return answer

    fake.reserve_path = reserve_path
    trainer = config(fake, root)
    writer = TieredStorageWriter(trainer, step=1)
    with caplog.at_level(logging.INFO, logger="hyperpod_sim.sdk.agent"):
        if mode == "save":
            save(training_state(1, 0), storage_writer=writer)
        else:
            async_save(training_state(1, 0), storage_writer=writer).result()

    victim, before = planted["victim"]
    state = training_state(987, 0)
    assert load_latest(state, trainer).step == 1
    assert same(state, training_state(1, 0))  # saved whole, whichever way it went
    assert set(fake.shards) == {("job", 0, 1), ("job", 1, 1)}
    if case == "the-reserved-file":  # the control: written in place and committed
        assert (fake.committed, fake.aborted) == (["t0"], [])
        assert victim.read_bytes() != before
        return
    # The save went over HTTP: the reservation was given back, nothing committed from the file.
    assert (fake.committed, fake.aborted) == ([], ["t0"])
    assert "the agent's reservation names a file not to map" in caplog.text
    if case == "fifo":
        assert victim.is_fifo()
    else:
        assert victim.read_bytes() == before


@pytest.mark.parametrize("case", [*ATTACKS, "the-agents-copy"])
def test_a_shard_located_in_a_foreign_file_is_never_read(
    fake: FakeAgent, root: Path, tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Over HTTP (no fast path): the job's step 1. The file planted holds rank 0's shard (a copy
    # of another save would be refused by its checksum whatever its path: the metadata names it).
    http = config(fake, root, fast_path=False)
    save(training_state(1, 0), storage_writer=TieredStorageWriter(http, step=1))
    shard = fake.shards[("job", 0, 1)]
    answer, _ = plant(case, root, tmp_path, shard)
    fake.locate = lambda ns, rank, step: (Path(answer), shard) if (ns, rank) == ("job", 0) else None
    fake.reads.clear()

    state = training_state(987, 0)
    with caplog.at_level(logging.INFO, logger="hyperpod_sim.sdk.agent"):
        loaded = load_latest(state, config(fake, root))

    assert (loaded.step, loaded.served_by) == (1, {0: "memory"})
    assert same(state, training_state(1, 0))
    if case == "the-agents-copy":  # the control: mapped, never read over HTTP
        assert ("job", 0, 1) not in fake.reads
        return
    assert ("job", 0, 1) in fake.reads  # what the agent served over HTTP
    assert "the agent names a file not to read from" in caplog.text
