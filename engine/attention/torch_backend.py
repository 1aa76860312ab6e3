"""Reference paged attention in plain torch: correct on any device, the oracle for kernels.

Chunks are attended one by one with SDPA. Where a chunk's context sits in consecutive pool blocks
(the block pool tries to arrange that) its K/V are a slice of the pool, so nothing is copied; a
fragmented context is gathered through its block table. A chunk that starts at position 0 uses its
own fresh K/V. On a CPU this beats padding every decode to the longest context and gathering
them all, which moved several times more memory than the weights themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.engine.attention.backend import AttentionBackend
from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.models.layer_ops import TORCH_LAYER_OPS


class TorchAttentionBackend(AttentionBackend):
    layer_ops = TORCH_LAYER_OPS  # norms, RoPE and SwiGLU in plain torch
    name = "torch"
    prefers_contiguous_blocks = True

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        write_kv_slots(key, value, key_cache, value_cache, slot_mapping)

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
        out_dtype = query.dtype
        if key_cache.dtype != out_dtype:  # a float32 pool under a half-precision model (engine/runner/device.py)
            query, key, value = (t.to(key_cache.dtype) for t in (query, key, value))
        self.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        flat_key, flat_value = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # [slots, kv_heads, head_dim]
        pieces = []  # per chunk [n, num_heads, head_dim], concatenated once at the end
        for chunk in metadata.chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
            if chunk.num_query_tokens == 1:
                pieces.append(
                    _decode(query[rows], flat_key, flat_value, chunk, key_cache, value_cache, scale, sliding_window)
                )
                continue
            pieces.append(attend_prefill_chunk(query, key, value, key_cache, value_cache, chunk, scale, sliding_window))
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous()
        return out if out.dtype == out_dtype else out.to(out_dtype)


def write_kv_slots(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    key_cache.flatten(0, 1).index_copy_(0, slot_mapping, key)
    value_cache.flatten(0, 1).index_copy_(0, slot_mapping, value)


def attend_prefill_chunk(
    query,
    key,
    value,
    key_cache,
    value_cache,
    chunk: ChunkContext,
    scale: float,
    sliding_window: int | None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [num_query_tokens, num_heads, head_dim]
    """One multi-token chunk of the packed step: over its own fresh K/V when it starts the
    sequence, else over its cached context (a view of the pool when contiguous), optionally cast."""
    rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
    if chunk.start_position == 0:
        chunk_key, chunk_value = key[rows], value[rows]
    else:
        chunk_key = _context(key_cache.flatten(0, 1), key_cache, chunk)
        chunk_value = _context(value_cache.flatten(0, 1), value_cache, chunk)
    chunk_query = query[rows]
    if compute_dtype is not None:
        chunk_query, chunk_key, chunk_value = (t.to(compute_dtype) for t in (chunk_query, chunk_key, chunk_value))
    return attend(chunk_query, chunk_key, chunk_value, chunk.start_position, scale, sliding_window)


def _context(flat: torch.Tensor, cache: torch.Tensor, chunk: ChunkContext) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim]: a view when contiguous, else a gather."""
    if chunk.contiguous_start_slot is not None:
        start = chunk.contiguous_start_slot
        return flat[start : start + chunk.context_len]
    blocks = torch.tensor(chunk.block_ids, device=cache.device)
    return cache[blocks].flatten(0, 1)[: chunk.context_len]


def _decode(query, flat_key, flat_value, chunk: ChunkContext, key_cache, value_cache, scale, sliding_window):
    """One query over its context, built as [1, kv_heads, context, head_dim] views in one op each:
    per-op dispatch, not arithmetic, dominates a single decode's attention on a CPU."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    context_len, first = chunk.context_len, 0
    if chunk.contiguous_start_slot is None:
        flat_key, flat_value = _context(flat_key, key_cache, chunk), _context(flat_value, value_cache, chunk)
    else:
        first = chunk.contiguous_start_slot
    if sliding_window is not None and context_len > sliding_window:  # the window is a suffix
        first, context_len = first + context_len - sliding_window, sliding_window
    num_kv_heads = flat_key.shape[1]
    shape = (1, num_kv_heads, context_len, head_dim)
    strides = (0, head_dim, num_kv_heads * head_dim, 1)
    offset = first * num_kv_heads * head_dim
    k = flat_key.as_strided(shape, strides, flat_key.storage_offset() + offset)
    v = flat_value.as_strided(shape, strides, flat_value.storage_offset() + offset)
    out = F.scaled_dot_product_attention(
        query.view(1, num_heads, 1, head_dim), k, v, scale=scale, enable_gqa=True
    )  # [1, num_heads, 1, head_dim]
    return out.view(1, num_heads, head_dim)


def attend(query, key, value, start_position: int, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal attention of `query` (positions start..start+n) over `key`/`value` (positions 0..)."""
    num_queries = query.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, context, head_dim]
    v = value.transpose(0, 1).unsqueeze(0)
    if start_position == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_positions = torch.arange(num_queries, device=query.device)[:, None] + start_position
        key_positions = torch.arange(key.shape[0], device=query.device)[None, :]
        mask = key_positions <= query_positions  # [n, context]
        if sliding_window is not None:
            mask &= query_positions - key_positions < sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
