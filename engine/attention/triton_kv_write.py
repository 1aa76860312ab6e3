"""Triton kernel that scatters the step's new K and V into the paged pool at `slot_mapping`.

Same signature and result as `TorchAttentionBackend.write_kv` (two `index_copy_`s): one program
per new token writes all its KV heads of K and V, so a step costs one launch instead of two.
Slot s lives at pool[s // block_size, s % block_size]; strides are passed, so K/V may be views
(V comes straight out of the fused qkv projection's split and is not contiguous). A negative slot
is skipped, the convention for padding tokens that own no cache slot.

Under TRITON_INTERPRET=1 (set before triton is imported) the kernel runs on CPU tensors, which
is how the tests check it on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.engine.attention.kernel_launch import KernelLaunch


# The block size varies by engine, and the slot mapping is read one scalar per program: neither
# gains from specialisation, and each would add a compiled variant per value class
# (engine/attention/triton_paged_attention.py says more).
@triton.jit(do_not_specialize=["block_size"], do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    block_size,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # next powers of two: tl.arange needs them
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride overflows int32 on big pools
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, NUM_KV_HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    key_dst = key_cache_ptr + block * stride_kc_block + offset * stride_kc_token + heads * stride_kc_head + dims
    tl.store(key_dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    value_dst = value_cache_ptr + block * stride_vc_block + offset * stride_vc_token + heads * stride_vc_head + dims
    tl.store(value_dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64
) -> None:
    if key.shape[0] == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    write_kv_launch(key, value, key_cache, value_cache, slot_mapping).run()


def write_kv_launch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32 or int64
) -> KernelLaunch:
    """The launch `write_kv` runs, built without running it (tests compile it for sm_90)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV pool must be contiguous in head_dim")
    args = (
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
    )
    options = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )
    return KernelLaunch(_write_kv_kernel, (num_tokens,), args, options)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
