"""The physical KV blocks: free list, reference counts and the prefix-cache index.

Mechanism only; `KVCacheManager` decides which sequence gets which block. A block whose
reference count drops to zero goes to the tail of the free list but keeps its content hash, so a
later request with the same prefix can revive it. Allocation takes the head of the free list,
i.e. the least recently freed block, and only then forgets its hash (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

BlockKey = Hashable  # (parent block's hash, tuple of this block's token ids)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, prefer_contiguous: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Keep each sequence's blocks consecutive when the pool allows it, so an attention backend
        # that cannot read through block tables (the torch one) can use a view instead of a gather.
        self.prefer_contiguous = prefer_contiguous
        self._frontier = 0  # where the next sequence's run of blocks starts looking
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockKey, int] = {}
        # Insertion order is the eviction order: oldest-freed first.
        self._free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def allocate(self, preferred: int | None = None) -> int:
        """Take `preferred` if it is free, else the least recently freed block; evict its cached content."""
        if preferred is not None and preferred in self._free_blocks:
            del self._free_blocks[preferred]
            block_id = preferred
        else:
            block_id, _ = self._free_blocks.popitem(last=False)
        key = self.block_keys[block_id]
        if key is not None:
            del self.cached_blocks[key]
            self.block_keys[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def find_free_run(self, length: int) -> int | None:
        """First block of `length` consecutive free blocks, searching from the frontier (wrapping once).

        The frontier then moves past the run, so sequences started one after another get disjoint
        regions and can grow in place. Cost is O(num_blocks) at worst, paid once per sequence start.
        """
        if not self.prefer_contiguous or length > len(self._free_blocks):
            return None
        length = max(length, 1)
        start, scanned = self._frontier, 0
        while scanned < self.num_blocks:
            if start + length > self.num_blocks:
                scanned += self.num_blocks - start
                start = 0
                continue
            busy = next((i for i in range(length) if start + i not in self._free_blocks), None)
            if busy is None:
                self._frontier = (start + length) % self.num_blocks
                return start
            scanned += busy + 1
            start += busy + 1
        return None

    def lookup(self, key: BlockKey) -> int | None:
        if not self.enable_prefix_caching:
            return None
        return self.cached_blocks.get(key)

    def share(self, block_id: int) -> None:
        """Add a reference to a cached block (reviving it if it sat in the free list)."""
        if self.ref_counts[block_id] == 0:
            del self._free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def register(self, block_id: int, key: BlockKey) -> None:
        """Record that a full block holds the K/V of `key`'s tokens; first writer wins."""
        if not self.enable_prefix_caching or self.block_keys[block_id] is not None:
            return
        if key in self.cached_blocks:
            return  # another sequence computed the same block first; keep that copy
        self.cached_blocks[key] = block_id
        self.block_keys[block_id] = key

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Tail blocks first, so they are evicted first."""
        for block_id in reversed(block_ids):
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free_blocks[block_id] = None

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free_blocks
