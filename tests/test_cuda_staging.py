"""Issue 18, CUDA staging: device-to-host copies go straight into the agent's shared memory, which
is registered as pinned memory once per mapped buffer (never per step) and unregistered before it
is unmapped, and the copies run on a side stream (``hyperpod_sim/sdk/device_copy.py``).

The registration logic runs everywhere, with a registrar that records what the SDK asks the
driver (the real one is ``cudaHostRegister``); the tests marked ``cuda`` need a GPU and run on a
lent device (``bench/gpu_checkpoint.sh`` runs this file there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save

from hyperpod_sim.sdk.agent import AgentClient
from hyperpod_sim.sdk.checkpoint import TieredCheckpointConfig, TieredStorageReader, TieredStorageWriter
from hyperpod_sim.sdk.device_copy import CudaHostRegistrar, DeviceCopies
from tests.conftest import ControlPlane
from tests.tier import cluster, create_namespace, get, url

pytestmark = pytest.mark.patient_heartbeats

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")


class RecordingRegistrar:
    """What the SDK asks the driver: (address, size) registered, addresses unregistered."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> bool:
        self.registered.append((address, size))
        return not self.refuse

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def saves(client: AgentClient, agent: str, steps: range, size: int) -> list[str]:
    """Fast-path writes as the writer makes them for CUDA tensors: reserve, pin, fill, commit.
    Returns the buffer ids written into."""
    buffers = []
    for step in steps:
        write = client.reserve("job", 0, step, size)
        assert write is not None
        write.pin_for_cuda()
        write.view[:] = bytes([step % 256]) * size
        buffers.append(write.buffer_id)
        client.commit(write)
    return buffers


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_each_buffer_is_registered_once_and_unregistered_before_it_is_unmapped(
    agent_plane: ControlPlane,
) -> None:
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "pin", 1))
    assert create_namespace(a, "job", 1, steps_retained=3).status_code == 201
    registrar = RecordingRegistrar()
    client = AgentClient(a, host_registrar=registrar)
    try:
        size = 256 << 10
        buffers = saves(client, a, range(1, 13), size)
        # Twelve saves went round the rank's rotation: one registration per buffer, none per step.
        assert len(set(buffers)) < len(buffers)
        assert len(registrar.registered) == len(set(buffers))
        assert all(registered_size == size for _, registered_size in registrar.registered)
        assert registrar.unregistered == []
    finally:
        client.close()
    # Closing unmaps every buffer; each registered one was unregistered first, at its address.
    assert sorted(registrar.unregistered) == sorted(address for address, _ in registrar.registered)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_buffer_the_driver_refuses_is_not_asked_again_and_the_save_still_lands(
    agent_plane: ControlPlane,
) -> None:
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "refuse", 1))
    assert create_namespace(a, "job", 1, steps_retained=3).status_code == 201
    registrar = RecordingRegistrar(refuse=True)
    client = AgentClient(a, host_registrar=registrar)
    try:
        buffers = saves(client, a, range(1, 9), 64 << 10)
        assert len(registrar.registered) == len(set(buffers))  # asked once per buffer, refused
        assert get(a, "job", 0, 8).content == bytes([8]) * (64 << 10)  # written, unpinned
    finally:
        client.close()
    assert registrar.unregistered == []  # nothing was registered, nothing to unregister


def test_cpu_copies_need_no_stream() -> None:
    copies = DeviceCopies()
    source, dest = torch.arange(8.0), torch.empty(8)
    copies.copy(dest, source)
    assert torch.equal(dest, source)
    assert not copies.on_device
    copies.wait()


def test_the_real_registrar_registers_nothing_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA tests below cover the real registrar")
    assert CudaHostRegistrar().register(0, 4096) is False


# -- on a GPU


@cuda
def test_side_stream_copies_see_the_values_as_of_the_save() -> None:
    """Work queued on the trainer's stream before the save is in the copy; work queued after it
    is not (the copy waited for the one, and ran before the other could change the source)."""
    source = torch.zeros(1 << 20, device="cuda")
    dest = torch.empty(1 << 20, pin_memory=True)
    source.add_(1)  # queued before the save
    copies = DeviceCopies()
    copies.copy(dest, source)
    copies.wait()
    source.add_(1)  # queued after it
    torch.cuda.synchronize()
    assert copies.on_device is False  # wait() ended the staging
    assert torch.all(dest == 1)


def cuda_state(step: int) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(step)
    return {
        "model": {f"w{i}": torch.randn(256, 1024, device="cuda", generator=generator) for i in range(8)},
        "step": step,
    }


@cuda
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_cuda_state_saves_through_pinned_shared_memory_and_loads_back(agent_plane: ControlPlane) -> None:
    sm: Any = agent_plane.client()
    (a,) = (url(n) for n in cluster(sm, agent_plane, "gpu", 1))
    config = TieredCheckpointConfig(namespace="gpujob", world_size=1, agent_url=a, fast_path=True)
    client = config.client()
    for step in range(1, 7):
        async_save(cuda_state(step), storage_writer=TieredStorageWriter(config, step=step)).result()
    pinned = [entry for entry in client._mappings.values() if entry.pinned]
    assert pinned  # the rank's buffers are registered...
    assert len(pinned) <= 5  # ...its rotation (retention + 2 with the write ahead), not one per step
    target = {"model": {f"w{i}": torch.empty(256, 1024, device="cuda") for i in range(8)}, "step": -1}
    load(target, storage_reader=TieredStorageReader(config, step=6))
    expected = cuda_state(6)
    assert target["step"] == 6
    assert all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())
