"""Paged attention for CPUs: every decode of a step in one C++ kernel call, prefill chunks in SDPA.

Decodes are most of a CPU step's attention calls (one per running sequence and layer) and each
does little arithmetic, so per-call dispatch dominated them in the torch reference; the kernel
(engine/csrc/paged_decode_attention.cpp) attends them all at once straight from the pool, in the
pool's dtype, so half-precision models keep a half-precision pool (half the bytes per token). A
prefill chunk has many queries and is arithmetic-bound: it keeps torch's SDPA, run in float32
because torch's half-precision CPU SDPA is several times slower than its float32 one.
"""

from __future__ import annotations

import torch

from engine.attention.cpu_kernels import load_cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import attend_prefill_chunk, write_kv_slots
from engine.models.layer_ops import CpuLayerOps


class CpuAttentionBackend:
    name = "cpu"
    prefers_contiguous_blocks = True  # prefill chunks over a cached prefix read it as a view
    needs_varlen_tables = True  # the decode kernel reads the step's block table and context lengths

    def __init__(self):
        load_cpu_kernels()  # raises CpuKernelsUnavailable with the reason
        self.layer_ops = CpuLayerOps()  # the same library's fused norm, RoPE and SwiGLU kernels
        self._decode = torch.ops.tokenloom_cpu.paged_decode_attention

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        pool_dtype = key_cache.dtype
        write_kv_slots(key.to(pool_dtype), value.to(pool_dtype), key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        num_decodes, tables = metadata.num_decodes, metadata.tables
        if num_decodes:
            # The kernel takes one dtype; a pool wider than the model (never chosen for this
            # backend, but a caller may pass one) gets converted queries and a scratch output.
            same_dtype = pool_dtype == out.dtype
            decode_out = out[:num_decodes] if same_dtype else out.new_empty(out[:num_decodes].shape, dtype=pool_dtype)
            self._decode(
                decode_out, query[:num_decodes].to(pool_dtype), key_cache, value_cache,
                tables.block_table[:num_decodes], tables.context_lens[:num_decodes], scale, sliding_window or 0,
            )
            if not same_dtype:
                out[:num_decodes] = decode_out
        compute_dtype = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
        for chunk in metadata.chunks[num_decodes:]:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
            out[rows] = attend_prefill_chunk(
                query, key, value, key_cache, value_cache, chunk, scale, sliding_window, compute_dtype
            )
        return out
