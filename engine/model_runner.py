"""Turns a scheduler plan into flat tensors and runs ONE forward pass for the whole packed step."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, ChunkContext
from engine.models.decoder import DecoderModel
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        num_blocks: int,
        block_size: int,
        backend,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.device = device
        shape = model.shape
        # One pool per layer, K and V: [num_blocks, block_size, num_kv_heads, head_dim].
        pool = torch.zeros(
            shape.num_layers, 2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim,
            dtype=dtype, device=device,
        )
        self.kv_caches = [(pool[i, 0], pool[i, 1]) for i in range(shape.num_layers)]

    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Logits of the sampled chunks, in plan order: [num_sampled, vocab_size] float32."""
        input_ids, positions, sample_indices, metadata = self.prepare(plan)
        logits = self.model(input_ids, positions, self.kv_caches, metadata, self.backend, sample_indices)
        return logits.float()

    def prepare(self, plan: SchedulerOutput):
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_indices: list[int] = []
        contexts: list[ChunkContext] = []
        for chunk in plan.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            offset = len(token_ids)
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            if chunk.samples:
                sample_indices.append(offset + chunk.num_tokens - 1)
            context_blocks = table[: -(-end // block_size)]
            contexts.append(
                ChunkContext(offset, chunk.num_tokens, end, context_blocks, _contiguous_start(context_blocks, block_size))
            )
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=sum(1 for c in plan.chunks if c.num_tokens == 1),
            chunks=contexts,
        )
        return self._tensor(token_ids), self._tensor(positions), self._tensor(sample_indices), metadata

    def _tensor(self, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)


def _contiguous_start(blocks: list[int], block_size: int) -> int | None:
    first = blocks[0]
    if blocks[-1] - first != len(blocks) - 1 or any(b != first + i for i, b in enumerate(blocks)):
        return None
    return first * block_size
