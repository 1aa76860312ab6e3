"""Host-memory blocks for the KV of preempted sequences (`[kv_cache] swap_space_gb`).

Plain Python: which host blocks are free. The model runner owns the tensor behind them and does
the copies the scheduler plans (`SchedulerOutput.swap_out` / `swap_in`).
"""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` host blocks, or None (nothing taken) if there are not that many free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
