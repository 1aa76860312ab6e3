"""Attention backend on Triton kernels: the same interface as `TorchAttentionBackend`, its oracle.

One KV-write launch and one paged-attention launch per layer, whatever mix of decodes and prefill
chunks the step holds. The kernels read K/V through the block table, so the block pool need not
keep a sequence's blocks consecutive (`prefers_contiguous_blocks = False`), and they need the
step's device-side `VarlenTables`, which the model runner builds once per step when a backend
sets `needs_varlen_tables`.

Triton compiles for CUDA. Under TRITON_INTERPRET=1, set before triton is first imported, the
same kernels run on CPU tensors in numpy (slow; for tests only); `RUNS_IN_INTERPRETER` says
which of the two the kernels were built for.
"""

from __future__ import annotations

import torch

from tokenloom.engine.attention.backend import AttentionBackend
from tokenloom.engine.attention.metadata import AttentionMetadata, VarlenTables
from tokenloom.engine.attention.triton_kv_write import write_kv
from tokenloom.engine.attention.triton_paged_attention import RUNS_IN_INTERPRETER, paged_attention
from tokenloom.engine.models.layer_ops import TORCH_LAYER_OPS

__all__ = ["RUNS_IN_INTERPRETER", "TritonAttentionBackend"]


class TritonAttentionBackend(AttentionBackend):
    layer_ops = TORCH_LAYER_OPS  # norms, RoPE and SwiGLU in plain torch
    name = "triton"
    prefers_contiguous_blocks = False
    needs_varlen_tables = True

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if metadata.tables is None:
            # Metadata built by hand (e.g. the start-up memory profile) rather than by the runner:
            # build the tables once here and keep them for the remaining layers of the step.
            metadata.tables = VarlenTables.build(metadata.chunks, query.device)
        # New tokens go into the pool first, so the kernel reads prefix and chunk from one place.
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_attention(query, key_cache, value_cache, metadata.tables, scale, sliding_window)
