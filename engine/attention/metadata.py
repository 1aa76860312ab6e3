"""What an attention backend needs to know about one packed step.

The step's tokens are laid out flat: first the decode tokens (one query each), then each
prefill chunk's tokens in order. Built once per step by the model runner and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    """Host-side description of one multi-token chunk (kept as ints: the reference backend loops)."""

    query_start: int  # offset of the chunk's first token in the flat batch
    num_query_tokens: int
    context_len: int  # tokens of the sequence in the cache after this step (start + num_query_tokens)
    block_ids: torch.Tensor  # [num_blocks_covering_context] long

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_query_tokens


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V goes in the pool
    num_decodes: int  # the first num_decodes tokens are single-query chunks
    decode_block_tables: torch.Tensor  # [num_decodes, max_decode_blocks] long, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] long, including the new token
    max_decode_context_len: int
    prefills: list[PrefillChunk]
    # Triton-style varlen view of the whole batch, for kernels that take every chunk at once.
    query_start_loc: torch.Tensor  # [num_chunks + 1] int32
    context_lens: torch.Tensor  # [num_chunks] int32
    block_tables: torch.Tensor  # [num_chunks, max_blocks] int32, padded with 0
