"""What an attention backend needs to know about one packed step.

The step's tokens are laid out flat, chunk after chunk (decodes first). Built once per step by the
model runner and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ChunkContext:
    """Host-side view of one chunk, for backends that attend chunk by chunk."""

    query_start: int  # offset of the chunk's first token in the flat batch
    num_query_tokens: int
    context_len: int  # tokens of the sequence in the cache after this step (start + num_query_tokens)
    block_ids: list[int]  # the blocks covering the context
    # First pool slot of the context when its blocks are consecutive in the pool: the context is
    # then a plain slice of the pool and needs no gather.
    contiguous_start_slot: int | None

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_query_tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V goes in the pool
    num_decodes: int  # the first num_decodes chunks have a single query token
    chunks: list[ChunkContext]
