"""Small host lists and tensors (per-row sampling parameters, row indices, grammar bitmasks) on the
device without a host wait.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronises the
stream: the host stops until every kernel queued before it has run (when the sampler runs, the
whole forward pass), once per tensor. Copied from pinned memory with `non_blocking=True`, the copy
is queued behind those kernels like any other and the host goes on; torch's pinned-memory
allocator does not hand the host buffer out again before the copy out of it has run. On other
devices the tensor is built directly, as before.
"""

from __future__ import annotations

import torch


def list_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`; on CUDA through pinned memory, non-blocking."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through a pinned copy of it (the caller may reuse its own
    buffer at once), non-blocking."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staging.copy_(tensor)
    return staging.to(device, non_blocking=True)
