"""What an attention backend needs to know about one packed step.

The step's tokens are laid out flat, chunk after chunk (decodes first). Built once per step by the
model runner and shared by all layers. `chunks` is the host-side view the torch backend walks;
`tables` is the device-side varlen view that kernels taking every chunk in one launch read, built
only for backends that ask for it (it costs a host-to-device copy per step).
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
    # then a plain slice of the pool and needs no gather. None when they are not, or when the
    # backend does not read it (`AttentionBackend.prefers_contiguous_blocks` false).
    contiguous_start_slot: int | None

    @property
    def start_position(self) -> int:
        return self.context_len - self.num_query_tokens


@dataclass(slots=True)
class VarlenTables:
    """Every chunk of the step at once, on the device, for kernels that attend in one launch."""

    query_start: torch.Tensor  # [num_chunks + 1] int32: chunk i's tokens are query_start[i]:query_start[i+1]
    context_lens: torch.Tensor  # [num_chunks] int32: tokens in the cache after this step
    block_table: torch.Tensor  # [num_chunks, max_blocks] int32: context blocks, padded with 0
    max_query_len: int  # on the host, so a launcher can size its tiles without a device sync

    @classmethod
    def build(cls, chunks: list[ChunkContext], device: torch.device) -> VarlenTables:
        """One int32 host buffer and ONE copy to the device (three small copies cost three syncs' latency)."""
        num_chunks = len(chunks)
        width = max(len(c.block_ids) for c in chunks)
        query_start = [0]
        for c in chunks:
            query_start.append(query_start[-1] + c.num_query_tokens)
        rows = [c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks]
        flat = query_start + [c.context_len for c in chunks] + [b for row in rows for b in row]
        buffer = torch.tensor(flat, dtype=torch.int32).to(device)
        return cls(
            query_start=buffer[: num_chunks + 1],
            context_lens=buffer[num_chunks + 1 : 2 * num_chunks + 1],
            block_table=buffer[2 * num_chunks + 1 :].view(num_chunks, width),
            max_query_len=max(c.num_query_tokens for c in chunks),
        )


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each new token's K/V goes in the pool
    num_decodes: int  # the first num_decodes chunks have a single query token
    chunks: list[ChunkContext]
    tables: VarlenTables | None = None  # built when the backend's `needs_varlen_tables` is true
