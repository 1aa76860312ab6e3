"""Persistent step-input buffers for CUDA: filled on the host, sent to the device in ONE copy.

Building each input with its own `torch.tensor(..., device="cuda")` costs one pageable copy per
tensor, each of which makes the host wait for the device. Here every input of a step lives in
one pinned host buffer with a twin on the device, at fixed offsets:

    int64  token_ids[max_tokens] | positions[max_tokens] | slot_mapping[max_tokens] | sample_indices[max_tokens]
    int32  query_start[max_seqs + 1] | context_lens[max_seqs] | table_slots[max_seqs]
           | table_updates[max_seqs * max_blocks_per_seq, 2]

A step writes the first entries of each section and copies bytes [0, end of its last table
update) with one non-blocking transfer. The block tables are not in it: they live on the device
in a persistent `slot_table` [num_slots, max_blocks_per_seq], one slot per sequence
(engine/runner/block_table_slots.py). A step sends only the entries that changed (`table_updates`,
(flat index, block id) pairs, none on most decode steps) and each chunk's slot (`table_slots`);
the device scatters the updates into the slot table and gathers the step's rows into
`block_table` [max_seqs, max_blocks_per_seq], the table the kernels read. `sample_indices` are the
rows whose logits the step needs: one per sampled chunk, then every position that scores a prompt
(prompt logprobs), so up to one per token.

Fixed offsets also give CUDA graphs stable input addresses: a graph captured on the first `n`
entries of each device view (and of `block_table`) reads whatever the next step packs there. The
host buffer is refilled only after the previous copy out of it finished (a fence); the device
buffers are overwritten in stream order, after the kernels that read them.

Padding (`pad_to`): entries past the step's own, up to a graph's batch size, are decodes that
write nothing (slot -1, which the KV-write kernel skips) and attend to nothing (context 0).
CPU steps do not use this: there, plain tensors from lists cost no device round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables
from tokenloom.engine.runner.block_table_slots import BlockTableSlots
from tokenloom.engine.runner.copy_fence import CopyFence

_INT64 = 8
_INT32 = 4
_UPDATE = 2 * _INT32  # one (flat index, block id) pair


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_tokens: int  # tokens in one step ([scheduler] max_num_batched_tokens, or more for graph padding)
    max_num_seqs: int  # chunks in one step
    max_blocks_per_seq: int  # block-table width: max_model_len / block_size, rounded up

    @property
    def num_table_slots(self) -> int:
        """Rows of the persistent block table: a step's chunks, and as many again for sequences
        that sit a step out (waiting for a prefill chunk, finished, preempted) and may return."""
        return 2 * self.max_num_seqs

    @property
    def max_table_updates(self) -> int:
        """Changed entries one step can send: every row of the step rewritten in full."""
        return self.max_num_seqs * self.max_blocks_per_seq


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
    def table_slots(self) -> int:
        return self.context_lens + self.limits.max_num_seqs * _INT32

    @property
    def table_updates(self) -> int:
        return self.table_slots + self.limits.max_num_seqs * _INT32

    def used_bytes(self, num_table_updates: int) -> int:
        """Bytes a step needs copied: everything up to its last table update."""
        return self.table_updates + num_table_updates * _UPDATE

    @property
    def total_bytes(self) -> int:
        return self.used_bytes(self.limits.max_table_updates)


@dataclass(slots=True)
class StepViews:
    """Typed views of one flat buffer (host or device), at the layout's offsets."""

    token_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64
    sample_indices: torch.Tensor  # [max_tokens] int64
    query_start: torch.Tensor  # [max_seqs + 1] int32
    context_lens: torch.Tensor  # [max_seqs] int32
    table_slots: torch.Tensor  # [max_seqs] int32: the slot-table row of each chunk
    table_updates: torch.Tensor  # [max_table_updates, 2] int32: (flat slot-table index, block id)

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
            table_slots=section(layout.table_slots, seqs, torch.int32),
            table_updates=section(layout.table_updates, 2 * limits.max_table_updates, torch.int32).view(-1, 2),
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
        width = limits.max_blocks_per_seq
        self.slots = BlockTableSlots(limits.num_table_slots, width)
        self.slot_table = torch.zeros(limits.num_table_slots, width, dtype=torch.int32, device=device)
        # The step's table, row i for chunk i: what the kernels (and captured graphs) read.
        self.block_table = torch.zeros(limits.max_num_seqs, width, dtype=torch.int32, device=device)
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
        seq_ids: list[int],
        num_decodes: int,
        pad_to: int | None = None,
    ) -> StepInputs:
        """Fill the host buffer with one step (padded to `pad_to` decodes) and send it to the device.

        `seq_ids[i]` names the sequence of `contexts[i]`: its block-table row persists across steps."""
        limits = self.layout.limits
        num_tokens, num_chunks = len(token_ids), len(contexts)
        rows = pad_to if pad_to is not None else num_chunks
        if num_tokens > limits.max_num_tokens or rows > limits.max_num_seqs:
            raise ValueError(
                f"a step of {num_tokens} tokens / {rows} chunks exceeds the buffers "
                f"({limits.max_num_tokens} tokens / {limits.max_num_seqs} chunks)"
            )
        self.fence.wait()  # the previous step's copy may still be reading the host buffer
        a = self._np
        num_updates = self.slots.plan(seq_ids, [c.block_ids for c in contexts], a["table_slots"], a["table_updates"])
        a["token_ids"][:num_tokens] = token_ids
        a["positions"][:num_tokens] = positions
        a["slot_mapping"][:num_tokens] = slots
        a["sample_indices"][: len(sample_indices)] = sample_indices
        query_start = a["query_start"]
        query_start[0] = 0
        query_start[1 : num_chunks + 1] = [c.query_start + c.num_query_tokens for c in contexts]
        a["context_lens"][:num_chunks] = [c.context_len for c in contexts]
        num_padded_tokens = num_tokens
        num_sampled = len(sample_indices)
        if pad_to is not None and pad_to > num_chunks:
            self._pad(num_tokens, num_chunks, num_sampled, pad_to)
            num_padded_tokens += pad_to - num_chunks
            num_sampled += pad_to - num_chunks
        nbytes = self.layout.used_bytes(num_updates)
        self.device_flat[:nbytes].copy_(self.host_flat[:nbytes], non_blocking=True)
        self.fence.record()
        d = self.device
        if num_updates:
            updates = d.table_updates[:num_updates]  # [n, 2]
            self.slot_table.view(-1).index_copy_(0, updates[:, 0].long(), updates[:, 1])
        torch.index_select(self.slot_table, 0, d.table_slots[:rows], out=self.block_table[:rows])
        tables = VarlenTables(
            query_start=d.query_start[: rows + 1],
            context_lens=d.context_lens[:rows],
            block_table=self.block_table[:rows],
            max_query_len=max((c.num_query_tokens for c in contexts), default=1),
        )
        metadata = AttentionMetadata(
            slot_mapping=d.slot_mapping[:num_padded_tokens],
            num_decodes=num_decodes + (rows - num_chunks),
            chunks=contexts,
            tables=tables,
        )
        return StepInputs(
            d.token_ids[:num_padded_tokens], d.positions[:num_padded_tokens], d.sample_indices[:num_sampled], metadata
        )

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
        a["table_slots"][num_chunks:pad_to] = 0  # any slot: a row of context 0 reads no block
