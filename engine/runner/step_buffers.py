"""Persistent step-input buffers for CUDA: filled on the host, sent to the device in ONE copy.

Building each input with its own `torch.tensor(..., device="cuda")` costs one pageable copy per
tensor, each of which makes the host wait for the device. Here every input of a step lives in
one pinned host buffer with a twin on the device, at fixed offsets:

    int64  token_ids[max_tokens] | positions[max_tokens] | slot_mapping[max_tokens] | sample_indices[max_tokens]
    int32  query_start[max_seqs + 1] | context_lens[max_seqs] | block_table[max_seqs, max_blocks_per_seq]

A step writes the first entries of each section and copies bytes [0, end of its last block-table
row) with one non-blocking transfer. `sample_indices` are the rows whose logits the step needs:
one per sampled chunk, then every position that scores a prompt (prompt logprobs), so up to one
per token. Fixed offsets also give CUDA graphs stable input addresses: a graph captured on the
first `n` entries of each device view reads whatever the next step packs there. The host buffer
is refilled only after the previous copy out of it finished (a fence); the device buffer is
overwritten in stream order, after the kernels that read it.

Padding (`pad_to`): entries past the step's own, up to a graph's batch size, are decodes that
write nothing (slot -1, which the KV-write kernel skips) and attend to nothing (context 0).
CPU steps do not use this: there, plain tensors from lists cost no device round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables
from tokenloom.engine.runner.copy_fence import CopyFence

_INT64 = 8
_INT32 = 4


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_tokens: int  # tokens in one step ([scheduler] max_num_batched_tokens, or more for graph padding)
    max_num_seqs: int  # chunks in one step
    max_blocks_per_seq: int  # block-table width: max_model_len / block_size, rounded up


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Byte offsets of each section of the flat buffer."""

    limits: StepLimits

    @property
    def token_ids(self) -> int:
        return 0

    @property
    def positions(self) -> int:
        return self.limits.max_num_tokens * _INT64

    @property
    def slot_mapping(self) -> int:
        return 2 * self.limits.max_num_tokens * _INT64

    @property
    def sample_indices(self) -> int:
        return 3 * self.limits.max_num_tokens * _INT64

    @property
    def query_start(self) -> int:
        return self.sample_indices + self.limits.max_num_tokens * _INT64

    @property
    def context_lens(self) -> int:
        return self.query_start + (self.limits.max_num_seqs + 1) * _INT32

    @property
    def block_table(self) -> int:
        return self.context_lens + self.limits.max_num_seqs * _INT32

    def used_bytes(self, num_chunks: int) -> int:
        """Bytes a step of `num_chunks` chunks needs copied: everything up to its last table row."""
        return self.block_table + num_chunks * self.limits.max_blocks_per_seq * _INT32

    @property
    def total_bytes(self) -> int:
        return self.used_bytes(self.limits.max_num_seqs)


@dataclass(slots=True)
class StepViews:
    """Typed views of one flat buffer (host or device), at the layout's offsets."""

    token_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    sample_indices: torch.Tensor  # [max_tokens] int64
    query_start: torch.Tensor  # [max_seqs + 1] int32
    context_lens: torch.Tensor  # [max_seqs] int32
    block_table: torch.Tensor  # [max_seqs, max_blocks_per_seq] int32

    @classmethod
    def of(cls, flat: torch.Tensor, layout: StepLayout) -> StepViews:
        limits = layout.limits
        tokens, seqs = limits.max_num_tokens, limits.max_num_seqs

        def section(offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
            return flat[offset : offset + count * dtype.itemsize].view(dtype)

        return cls(
            token_ids=section(layout.token_ids, tokens, torch.int64),
            positions=section(layout.positions, tokens, torch.int64),
            slot_mapping=section(layout.slot_mapping, tokens, torch.int64),
            sample_indices=section(layout.sample_indices, tokens, torch.int64),
            query_start=section(layout.query_start, seqs + 1, torch.int32),
            context_lens=section(layout.context_lens, seqs, torch.int32),
            block_table=section(layout.block_table, seqs * limits.max_blocks_per_seq, torch.int32)
            .view(seqs, limits.max_blocks_per_seq),
        )


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] on the device
    positions: torch.Tensor  # [num_tokens]
    sample_indices: torch.Tensor  # [num_sampled]
    metadata: AttentionMetadata


class StepBuffers:
    def __init__(self, limits: StepLimits, device: torch.device, fence: CopyFence, pin_memory: bool = True):
        self.layout = StepLayout(limits)
        self.fence = fence
        nbytes = self.layout.total_bytes
        self.host_flat = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.device_flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host = StepViews.of(self.host_flat, self.layout)
        self.device = StepViews.of(self.device_flat, self.layout)
        # numpy views of the host sections: assigning a Python list to a numpy slice is the
        # cheapest way to fill them.
        self._np = {name: getattr(self.host, name).numpy() for name in StepViews.__slots__}

    def pack(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        sample_indices: list[int],
        contexts: list[ChunkContext],
        num_decodes: int,
        pad_to: int | None = None,
    ) -> StepInputs:
        """Fill the host buffer with one step (padded to `pad_to` decodes) and send it to the device."""
        limits = self.layout.limits
        num_tokens, num_chunks = len(token_ids), len(contexts)
        rows = pad_to if pad_to is not None else num_chunks
        if num_tokens > limits.max_num_tokens or rows > limits.max_num_seqs:
            raise ValueError(f"a step of {num_tokens} tokens / {rows} chunks exceeds the buffers "
                             f"({limits.max_num_tokens} tokens / {limits.max_num_seqs} chunks)")
        self.fence.wait()  # the previous step's copy may still be reading the host buffer
        a = self._np
        a["token_ids"][:num_tokens] = token_ids
        a["positions"][:num_tokens] = positions
        a["slot_mapping"][:num_tokens] = slots
        a["sample_indices"][: len(sample_indices)] = sample_indices
        query_start = a["query_start"]
        query_start[0] = 0
        for i, c in enumerate(contexts):
            query_start[i + 1] = c.query_start + c.num_query_tokens
            a["context_lens"][i] = c.context_len
            a["block_table"][i, : len(c.block_ids)] = c.block_ids
        num_padded_tokens = num_tokens
        num_sampled = len(sample_indices)
        if pad_to is not None and pad_to > num_chunks:
            self._pad(num_tokens, num_chunks, num_sampled, pad_to)
            num_padded_tokens += pad_to - num_chunks
            num_sampled += pad_to - num_chunks
        nbytes = self.layout.used_bytes(rows)
        self.device_flat[:nbytes].copy_(self.host_flat[:nbytes], non_blocking=True)
        self.fence.record()
        d = self.device
        tables = VarlenTables(
            query_start=d.query_start[: rows + 1], context_lens=d.context_lens[:rows],
            block_table=d.block_table[:rows],
            max_query_len=max((c.num_query_tokens for c in contexts), default=1),
        )
        metadata = AttentionMetadata(
            slot_mapping=d.slot_mapping[:num_padded_tokens], num_decodes=num_decodes + (rows - num_chunks),
            chunks=contexts, tables=tables,
        )
        return StepInputs(d.token_ids[:num_padded_tokens], d.positions[:num_padded_tokens],
                          d.sample_indices[:num_sampled], metadata)

    def _pad(self, num_tokens: int, num_chunks: int, num_sampled: int, pad_to: int) -> None:
        """Decodes past the step's own that write no KV and attend to nothing."""
        a = self._np
        extra = pad_to - num_chunks
        token_end = num_tokens + extra
        a["token_ids"][num_tokens:token_end] = 0
        a["positions"][num_tokens:token_end] = 0
        a["slot_mapping"][num_tokens:token_end] = -1
        a["sample_indices"][num_sampled : num_sampled + extra] = np.arange(num_tokens, token_end)
        a["query_start"][num_chunks + 1 : pad_to + 1] = np.arange(num_tokens + 1, token_end + 1)
        a["context_lens"][num_chunks:pad_to] = 0
