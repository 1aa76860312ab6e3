"""Paged attention for CPUs in C++ kernels, one call per layer for all decodes (and prefill chunks).

Decodes are most of a CPU step's attention calls (one per running sequence and layer) and each
does little arithmetic, so per-call dispatch dominated them in the torch reference. Two layouts:

- float32 and bfloat16 pools on an AVX-512 CPU (block_size a multiple of 16, head_dim 32/64/128)
  are PACKED for SIMD (engine/cpu/csrc/packed_kv_layout.h): one kernel attends every chunk of the
  step, decodes and prefill chunks alike, 16 keys or 16 dims per instruction (bfloat16 through
  vdpbf16ps where the CPU has AVX512-BF16, widened to float32 FMAs where not, with the rounding of
  torch's bfloat16 flash attention either way); on a CPU with AMX, bfloat16 prefill chunks over
  16-slot blocks multiply on AMX tiles instead (the packed tiles are the micro-kernel's VNNI
  layout), which outruns the vdpbf16ps code on prompts of a hundred tokens and more;
- any other pool keeps the plain layout: decodes through engine/cpu/csrc/paged_decode_attention.cpp in
  the pool's dtype, prefill chunks through SDPA in float32 (torch's half-precision CPU SDPA is
  slower than its float32 one).

Only this backend reads or writes a packed pool; whole-block copies (swap, prefix sharing) are
layout-blind because a block occupies the same bytes either way.
"""

from __future__ import annotations

import torch

from tokenloom.engine.attention.backend import AttentionBackend
from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.attention.torch_backend import attend_prefill_chunk, write_kv_slots
from tokenloom.engine.cpu.kernels import load_cpu_kernels
from tokenloom.engine.cpu.layer_ops import CpuLayerOps

PACKED_DTYPES = (torch.bfloat16, torch.float32)  # the pool dtypes packed_paged_attention has kernels for
PACKED_HEAD_DIMS = (32, 64, 128)  # the head sizes packed_paged_attention is compiled for
PACKED_BLOCK_MULTIPLE = 16  # a packed tile serves 16 keys per instruction
AMX_PREFILL_BLOCK_SIZE = 16  # prefill chunks run on AMX tiles (where the CPU has AMX) over blocks of this size


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    prefers_contiguous_blocks = True  # prefill chunks over a cached prefix read it as a view
    needs_varlen_tables = True  # the decode kernel reads the step's block table and context lengths
    serves_decoder_stack = True  # qualifying models run all layers in one C++ call (engine/cpu/decoder_stack.py)

    def __init__(self):
        load_cpu_kernels()  # raises CpuKernelsUnavailable with the reason
        self.layer_ops = CpuLayerOps()  # the same library's fused norm, RoPE and SwiGLU kernels
        self._decode = torch.ops.tokenloom_cpu.paged_decode_attention
        self._packed_supported = torch.ops.tokenloom_cpu.packed_kv_supported()

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
        if self.uses_packed_layout(key_cache):
            return self._packed_forward(query, key, value, key_cache, value_cache, metadata, scale, sliding_window)
        pool_dtype = key_cache.dtype
        write_kv_slots(key.to(pool_dtype), value.to(pool_dtype), key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        num_decodes, tables = metadata.num_decodes, metadata.tables
        if num_decodes:
            # needs_varlen_tables is set, so the runner built them (a step without decodes may come without them).
            assert tables is not None, "decodes need the step's varlen tables"
            # The kernel takes one dtype; a pool wider than the model (never chosen for this
            # backend, but a caller may pass one) gets converted queries and a scratch output.
            same_dtype = pool_dtype == out.dtype
            decode_out = out[:num_decodes] if same_dtype else out.new_empty(out[:num_decodes].shape, dtype=pool_dtype)
            self._decode(
                decode_out,
                query[:num_decodes].to(pool_dtype),
                key_cache,
                value_cache,
                tables.block_table[:num_decodes],
                tables.context_lens[:num_decodes],
                scale,
                sliding_window or 0,
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

    def uses_packed_layout(self, key_cache: torch.Tensor) -> bool:
        """Whether this backend keeps `key_cache` (and its value pool) in the packed layout."""
        return not self._plain_layout_reasons(key_cache)

    def describe(self, key_cache: torch.Tensor) -> str:
        """For the start-up report: the kernels this pool gets and, when not the packed ones, why."""
        reasons = self._plain_layout_reasons(key_cache)
        if reasons:
            return f"plain KV layout: {', '.join(reasons)}"
        if key_cache.dtype == torch.float32:
            return "packed KV layout, float32 FMAs"
        if torch.ops.tokenloom_cpu.packed_kv_bf16_dot():
            amx = key_cache.shape[1] == AMX_PREFILL_BLOCK_SIZE and torch.ops.tokenloom_cpu.packed_prefill_amx()
            return "packed KV layout, bfloat16 dot products (AVX512-BF16)" + (
                "; prefill chunks on AMX tiles" if amx else ""
            )
        return "packed KV layout, bfloat16 widened to float32 FMAs (this CPU has no AVX512-BF16)"

    def _plain_layout_reasons(self, key_cache: torch.Tensor) -> list[str]:
        """Why the packed kernels cannot take this pool; empty when they can (the one place for their conditions)."""
        reasons = []
        if not self._packed_supported:
            reasons.append("this CPU has no AVX-512")
        if key_cache.dtype not in PACKED_DTYPES:
            reasons.append(f"{str(key_cache.dtype).removeprefix('torch.')} pool")
        if key_cache.shape[1] % PACKED_BLOCK_MULTIPLE:
            reasons.append(f"block_size {key_cache.shape[1]} is not a multiple of {PACKED_BLOCK_MULTIPLE}")
        if key_cache.shape[3] not in PACKED_HEAD_DIMS:
            reasons.append(f"head size {key_cache.shape[3]} (packed kernels: {'/'.join(map(str, PACKED_HEAD_DIMS))})")
        return reasons

    def _packed_forward(self, query, key, value, key_cache, value_cache, metadata, scale, sliding_window):
        pool_dtype = key_cache.dtype
        ops = torch.ops.tokenloom_cpu
        ops.write_packed_kv(key.to(pool_dtype), value.to(pool_dtype), key_cache, value_cache, metadata.slot_mapping)
        tables = metadata.tables
        out = torch.empty(query.shape, dtype=pool_dtype)
        ops.packed_paged_attention(
            out,
            query.to(pool_dtype),
            key_cache,
            value_cache,
            tables.query_start,
            tables.block_table,
            tables.context_lens,
            scale,
            sliding_window or 0,
        )
        return out if out.dtype == query.dtype else out.to(query.dtype)
