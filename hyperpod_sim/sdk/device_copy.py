"""Device-to-host copies into the agent's shared memory (the CUDA staging of a fast-path save).

Two parts, each small enough to test on its own:

- :class:`HostRegistrar`: registers a mapped buffer as page-locked (pinned) memory with the GPU
  driver once, so copies into it run at DMA speed instead of through a driver staging buffer.
  The SDK's agent client keeps one registration per mapped buffer for as long as the mapping
  lives (the rank's rotation is mapped once and reused from step to step), never one per step,
  and unregisters a buffer before it unmaps it. A buffer the driver refuses is remembered and not
  asked again (copies into it are slower, not wrong). :class:`CudaHostRegistrar` is the real
  one (``cudaHostRegister`` through torch's CUDA runtime bindings); tests give a recording one.
- :class:`DeviceCopies`: the copies of one staging, on a side stream per device. The side stream
  first waits for the work already queued on the current stream (the tensors' values as of the
  save), the copies are queued on it without blocking, and :meth:`DeviceCopies.wait` synchronizes
  that stream only: kernels the trainer queues on its own stream afterwards are not waited for,
  and the stall is the copies' launch and their completion, not a device-wide synchronize or an
  allocation. CPU tensors are copied at once, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is the trainer's; the agent client imports this module without it
    import torch

log = logging.getLogger(__name__)


class HostRegistrar(Protocol):
    def register(self, address: int, size: int) -> bool:
        """Register ``size`` bytes at ``address`` as pinned host memory; False if refused."""
        ...

    def unregister(self, address: int) -> None: ...


class CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime bindings; without
    a usable GPU nothing is registered."""

    def register(self, address: int, size: int) -> bool:
        import torch

        if not torch.cuda.is_available():
            return False
        result: Any = torch.cuda.cudart().cudaHostRegister(address, size, 0)  # type: ignore[no-untyped-call]
        code = int(result[0]) if isinstance(result, tuple) else int(result)
        if code != 0:
            log.info(
                "cudaHostRegister of a %d-byte buffer failed (error %s); copies will be slower", size, code
            )
        return code == 0

    def unregister(self, address: int) -> None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


# One copy stream per device, made on first use and kept: creating a stream per save would cost
# a driver call on the training thread.
_streams: dict[int, Any] = {}


def _copy_stream(index: int) -> Any:
    import torch

    stream = _streams.get(index)
    if stream is None:
        stream = _streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
    return stream


class DeviceCopies:
    """The copies of one staging (see the module docstring); ``wait`` before the copies are read."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def copy(self, dest: torch.Tensor, source: torch.Tensor) -> None:
        if not source.is_cuda:
            dest.copy_(source)
            return
        import torch

        index = source.get_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = _copy_stream(index)
            # The copy sees everything queued on the trainer's stream before the save.
            stream.wait_stream(torch.cuda.current_stream(index))
            self._streams[index] = stream
        with torch.cuda.stream(stream):
            dest.copy_(source, non_blocking=True)

    @property
    def on_device(self) -> bool:
        """Whether any copy went through a device's stream."""
        return bool(self._streams)

    def wait(self) -> None:
        """Block until every copy queued on a side stream is done (only those streams)."""
        for stream in self._streams.values():
            stream.synchronize()
        self._streams.clear()
