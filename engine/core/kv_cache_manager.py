"""Which blocks each sequence owns: block tables, slot allocation and automatic prefix caching.

Prefix caching (vLLM's scheme): a full block is identified by the hash of its parent block
chained with its own token ids, so equal prefixes map to equal keys whatever request they came
from. On admission a sequence reuses the longest run of cached full blocks at the start of its
tokens; at least its last token is always recomputed, because the step that computes it is the
one that produces the next token's logits. Blocks are only ever written past a sequence's cached
prefix, so a shared block is never written.
"""

from __future__ import annotations

from tokenloom.engine.core.block_pool import BlockPool
from tokenloom.engine.core.prompt_scoring import cacheable_prefix_tokens
from tokenloom.engine.core.sequence import Sequence
from tokenloom.engine.core.swap_space import SwapSpace


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        # seq_id -> chained hashes of the sequence's full blocks registered so far
        self._block_hashes: dict[int, list[int]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding the K/V of `seq`'s leading full blocks (longest hit run)."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        limit = cacheable_prefix_tokens(seq)
        if limit is not None:
            max_blocks = min(max_blocks, limit // self.block_size)
        hits: list[int] = []
        parent_hash: int | None = None
        for i in range(max_blocks):
            key = self._block_key(seq, i, parent_hash)
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent_hash = hash(key)
        return hits

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: tuple[int, ...] | list[int] = ()
    ) -> bool:
        """Give `seq` room for `num_new_tokens` more tokens; False (and no change) if the pool is short.

        `cached_blocks` (only for a sequence holding no blocks yet) are prefix-cache hits to share.
        """
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_computed = seq.num_computed_tokens + num_cached_tokens
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            assert not seq.block_table, "prefix hits are only taken by a sequence holding no blocks"
            hashes = []
            parent_hash: int | None = None
            for i, block_id in enumerate(cached_blocks):
                self.pool.share(block_id)
                parent_hash = hash(self._block_key(seq, i, parent_hash))
                hashes.append(parent_hash)
            self._block_hashes[seq.seq_id] = hashes
            seq.block_table.extend(cached_blocks)
            seq.num_computed_tokens = num_computed
        if num_new_blocks > 0:
            self._append_blocks(seq, num_new_blocks)
        return True

    def _append_blocks(self, seq: Sequence, num_new_blocks: int) -> None:
        table = seq.block_table
        preferred = None
        if self.pool.prefer_contiguous:
            # Grow in place; a fresh sequence looks for room for its whole expected length.
            preferred = table[-1] + 1 if table else self.pool.find_free_run(self.blocks_needed(seq.max_num_tokens))
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate(preferred))
            preferred = table[-1] + 1 if self.pool.prefer_contiguous else None

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_prompt_tokens
        self.num_prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled, so later requests can reuse them."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(hashes), num_full):
            parent_hash = hashes[-1] if hashes else None
            key = self._block_key(seq, i, parent_hash)
            self.pool.register(seq.block_table[i], key)
            hashes.append(hash(key))

    def swap_out(self, seq: Sequence, swap: SwapSpace) -> list[tuple[int, int]] | None:
        """Move `seq`'s computed KV to host blocks: (device block, host block) pairs to copy, or
        None when the swap space is short. Its device blocks are freed; `num_computed_tokens`
        stays, so nothing is recomputed when it comes back."""
        num_computed = seq.num_computed_tokens
        used = seq.block_table[: self.blocks_needed(num_computed)]
        host_blocks = swap.allocate(len(used)) if used else None
        if host_blocks is None:
            return None
        self.free(seq)
        seq.num_computed_tokens = num_computed
        seq.host_block_table = host_blocks
        return list(zip(used, host_blocks))

    def num_blocks_to_admit(self, seq: Sequence, budget: int) -> int:
        """Free blocks that admitting a waiting or swapped `seq` with a chunk of at most `budget`
        tokens takes (prefix-cache hits reused; a hit sitting in the free list is revived, so it
        counts)."""
        if seq.host_block_table:
            return self.blocks_needed(seq.num_computed_tokens + min(seq.num_uncomputed_tokens, budget))
        cached_blocks = self.find_cached_prefix(seq)
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_tokens = min(seq.num_tokens - num_cached_tokens, budget)
        return self.blocks_needed(num_cached_tokens + num_tokens) - len(cached_blocks) + num_revived

    def num_releasable_blocks(self, seq: Sequence) -> int:
        """Blocks that freeing `seq` would return to the pool (those no other sequence shares)."""
        return sum(1 for b in seq.block_table if self.pool.ref_counts[b] == 1)

    def swap_in(self, seq: Sequence, swap: SwapSpace, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Device blocks for a swapped sequence plus `num_new_tokens`: (host block, device block)
        pairs to copy, or None (no change) when the pool is short. Host blocks are released."""
        num_blocks = len(seq.host_block_table)
        if self.num_blocks_to_admit(seq, num_new_tokens) > self.pool.num_free_blocks:
            return None
        self._append_blocks(seq, num_blocks)
        pairs = list(zip(seq.host_block_table, seq.block_table))
        swap.free(seq.host_block_table)
        seq.host_block_table = []
        # The blocks are re-registered in the prefix cache as the sequence's steps complete.
        self._block_hashes[seq.seq_id] = []
        return pairs

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._block_hashes.pop(seq.seq_id, None)

    def _block_key(self, seq: Sequence, block_index: int, parent_hash: int | None):
        start = block_index * self.block_size
        return (parent_hash, tuple(seq.token_ids[start : start + self.block_size]))
