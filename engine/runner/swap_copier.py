"""The KV copies behind preemption by swapping: device pool blocks <-> pinned host blocks.

Order of operations, and why (CUDA):
- swap-out gathers the blocks on the device and copies them into the host pool with
  non-blocking DMA, then records the fence. Nothing on the host reads those bytes yet, so the
  host goes on building the step while the copy runs.
- swap-in waits on the fence FIRST: it reads host blocks on the host (a gather), which must not
  happen before the swap-out copies that wrote them have landed. The host-to-device copy itself
  is ordered after everything earlier on the stream.
- A host block reused by a later swap-out is only written by DMA on the same stream, so reuse
  needs no wait.
The host pool is block-major ([num_host_blocks, num_layers, 2, block_size, kv_heads, head_dim])
so each host block is one contiguous range: a run of consecutive host blocks is one DMA.
"""

from __future__ import annotations

import torch

from tokenloom.engine.runner.copy_fence import CopyFence


class SwapCopier:
    def __init__(self, device_pool: torch.Tensor, host_pool: torch.Tensor, fence: CopyFence):
        self.device_pool = device_pool  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.host_pool = host_pool  # [num_host_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        self.fence = fence

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: [(device block, host block)]."""
        device_ids = torch.tensor([d for d, _ in pairs], device=self.device_pool.device)
        staged = self.device_pool[:, :, device_ids].movedim(2, 0).contiguous()  # [n, L, 2, bs, h, d]
        for first, (host_start, count) in _runs([h for _, h in pairs]):
            self._copy_to_host(staged[first : first + count], host_start)
        self.fence.record()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: [(host block, device block)]."""
        self.fence.wait()
        host_blocks = self._read_host_blocks([h for h, _ in pairs])  # [n, L, 2, bs, h, d]
        device_ids = torch.tensor([d for _, d in pairs], device=self.device_pool.device)
        self.device_pool[:, :, device_ids] = host_blocks.to(self.device_pool.device, non_blocking=True).movedim(0, 2)

    def _copy_to_host(self, blocks: torch.Tensor, host_start: int) -> None:
        self.host_pool[host_start : host_start + blocks.shape[0]].copy_(blocks, non_blocking=True)

    def _read_host_blocks(self, host_ids: list[int]) -> torch.Tensor:
        return self.host_pool[torch.tensor(host_ids)]


def _runs(ids: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """[(index into ids, (first id, length))] for each maximal run of consecutive ids."""
    runs: list[tuple[int, tuple[int, int]]] = []
    for index, block in enumerate(ids):
        if runs and runs[-1][1][0] + runs[-1][1][1] == block:
            first, (start, count) = runs[-1]
            runs[-1] = (first, (start, count + 1))
        else:
            runs.append((index, (block, 1)))
    return runs
