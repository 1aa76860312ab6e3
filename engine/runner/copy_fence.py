"""A fence over asynchronous copies: the host waits on it before it reads memory a copy writes.

On CUDA a device-to-host copy into pinned memory returns before the bytes arrive, so any host
read of the destination (or host write of a pinned source the device is still reading) must
first wait for the copy. Recording an event after the copies and synchronising on it just
before that host access lets the host keep working while the copy runs. CPU copies finish
before they return, so there the fence does nothing.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CopyFence(Protocol):
    def record(self) -> None:
        """Mark every copy queued so far on the device's current stream."""

    def wait(self) -> None:
        """Block the host until the copies marked by the last `record` have finished."""


class NoCopyFence:
    """For devices whose copies are synchronous (CPU)."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class CudaCopyFence:
    """One CUDA event, re-recorded after each batch of copies."""

    def __init__(self, device: torch.device):
        self._device = device
        self._event = torch.cuda.Event()
        self._pending = False

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            self._event.synchronize()
            self._pending = False


def copy_fence_for(device: torch.device) -> CopyFence:
    return CudaCopyFence(device) if device.type == "cuda" else NoCopyFence()
