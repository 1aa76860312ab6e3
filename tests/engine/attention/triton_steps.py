"""Packed attention steps for the Triton kernel tests and the device check: random K/V in a pool of
shuffled blocks, with the metadata the model runner would build. Importable without a kernel
runtime (bench/gpu_variants.py builds these steps to count compiled variants, not to run them)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables


@dataclass
class Step:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    metadata: AttentionMetadata


def make_step(
    chunks: list[tuple[int, int]],  # (context_len after the step, num_query_tokens) per chunk
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Step:
    """A packed step whose chunks own shuffled (non-contiguous) pool blocks full of random K/V."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-context_len // block_size) for context_len, _ in chunks]
    num_blocks = sum(needed) + 3  # spare blocks of garbage no chunk owns
    free = list(range(num_blocks))
    rng.shuffle(free)
    contexts, slots, offset = [], [], 0
    for (context_len, num_queries), num_chunk_blocks in zip(chunks, needed):
        blocks = [free.pop() for _ in range(num_chunk_blocks)]
        contexts.append(ChunkContext(offset, num_queries, context_len, blocks, _contiguous_start(blocks, block_size)))
        slots.extend(
            blocks[p // block_size] * block_size + p % block_size for p in range(context_len - num_queries, context_len)
        )
        offset += num_queries

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decodes=sum(1 for _, n in chunks if n == 1),
        chunks=contexts,
        tables=VarlenTables.build(contexts, torch.device(device)),
    )
    return Step(
        query=randn(offset, num_heads, head_dim),
        key=randn(offset, num_kv_heads, head_dim),
        value=randn(offset, num_kv_heads, head_dim),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        metadata=metadata,
    )


def _contiguous_start(blocks: list[int], block_size: int) -> int | None:
    """What the model runner records: the torch backend slices the pool when blocks are consecutive."""
    return blocks[0] * block_size if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
