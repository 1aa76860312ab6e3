"""Reference paged attention in plain torch: correct on any device, the oracle for kernels.

Decodes are batched: their K/V are gathered through the block tables into one padded tensor and
attended with a length mask in a single SDPA call. Prefill chunks (few per step) are attended one
by one; a chunk that starts at position 0 uses its own fresh K/V and SDPA's causal mode, a chunk
that continues a cached prefix reads the prefix back from the pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        flat_shape = (-1, key_cache.shape[2], key_cache.shape[3])
        key_cache.view(flat_shape).index_copy_(0, slot_mapping, key)
        value_cache.view(flat_shape).index_copy_(0, slot_mapping, value)

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
        self.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        num_decodes = metadata.num_decodes
        if num_decodes:
            output[:num_decodes] = self._decode(
                query[:num_decodes], key_cache, value_cache, metadata, scale, sliding_window
            )
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
            if chunk.start_position == 0:
                chunk_key, chunk_value = key[rows], value[rows]
            else:
                chunk_key = _gather_context(key_cache, chunk.block_ids, chunk.context_len)
                chunk_value = _gather_context(value_cache, chunk.block_ids, chunk.context_len)
            output[rows] = _prefill_attention(
                query[rows], chunk_key, chunk_value, chunk.start_position, scale, sliding_window
            )
        return output

    def _decode(self, query, key_cache, value_cache, metadata, scale, sliding_window):
        num_blocks = -(-metadata.max_decode_context_len // key_cache.shape[1])
        tables = metadata.decode_block_tables[:, :num_blocks]
        batch = tables.shape[0]
        # [batch, num_blocks * block_size, num_kv_heads, head_dim] -> heads first for SDPA
        keys = key_cache[tables].flatten(1, 2).transpose(1, 2)
        values = value_cache[tables].flatten(1, 2).transpose(1, 2)
        key_positions = torch.arange(keys.shape[2], device=query.device)
        lens = metadata.decode_context_lens[:, None]
        mask = key_positions[None, :] < lens  # [batch, padded_context]
        if sliding_window is not None:
            mask &= key_positions[None, :] > lens - 1 - sliding_window
        out = F.scaled_dot_product_attention(
            query.view(batch, -1, 1, query.shape[-1]),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.view(batch, -1, query.shape[-1])


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    # [num_blocks, block_size, num_kv_heads, head_dim] -> [context_len, num_kv_heads, head_dim]
    return cache[block_ids].flatten(0, 1)[:context_len]


def _prefill_attention(query, key, value, start_position: int, scale: float, sliding_window: int | None):
    """Causal attention of `query` (positions start..start+n) over `key`/`value` (positions 0..)."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
    k = key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, context, head_dim]
    v = value.transpose(0, 1).unsqueeze(0)
    if start_position == 0 and sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_positions = torch.arange(query.shape[0], device=query.device)[:, None] + start_position
        key_positions = torch.arange(key.shape[0], device=query.device)[None, :]
        mask = key_positions <= query_positions  # [n, context]
        if sliding_window is not None:
            mask &= query_positions - key_positions < sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
