"""Triton paged attention for the packed mixed batch: ONE varlen kernel for decodes and prefill chunks.

Why one kernel and not a decode kernel plus a prefill kernel: a step of this engine is a mix of
single-token decodes and prefill chunks that attend to their cached prefix. Seen from the kernel
a decode is just a chunk of one query token whose context is all cached, so the same program
serves both; one launch per layer keeps the launch count flat however the step is mixed, and
there is one algorithm to test against the torch reference instead of two.

Algorithm (flash attention over a block table, online softmax in fp32):
- Work unit: (query block, KV head). A query block is BLOCK_Q consecutive query tokens of ONE
  chunk times the GROUP query heads that share the KV head (GQA), i.e. BLOCK_M = BLOCK_Q * GROUP
  rows of a [BLOCK_M, head_dim] Q tile. Packing the group into the rows lets a decode token (one
  query) still fill a tile of at least 16 rows when GROUP is large, and makes every K/V tile that
  is loaded serve all heads of its group. GROUP need not be a power of two (Qwen2-0.5B has 7).
- Grid axis 0 gives each chunk `query_start[i] // BLOCK_Q + i` as its first query block, an upper
  bound on the blocks it needs (vLLM's trick); a program finds its chunk by binary search over
  `query_start` and exits when its block lies past the chunk's end. No host-side work list.
- Keys are visited in tiles of TILE_N pool slots. Each key position is translated through the
  block table (position // block_size -> physical block, position % block_size -> row), so any
  block_size works (no page-size constraint): a tile may straddle several pool blocks.
- Masks: causal (key position <= query position), optional sliding window (query - key <
  window, the same rule as the torch reference), padded rows, padded head_dim (head_dim is padded
  to a power of two >= 16 for tl.dot, so 48 or 80 work), and the chunk's context length.
  The loop only visits tiles inside [lowest window start, last query position] of the block.
- The chunk's own new tokens are read back from the pool: the backend writes them first, so
  "attend to the cached prefix" and "attend to the new tokens" are one and the same loop.

Known limit: a decode with a very long context is one program per KV head walking every tile
(no split-K / flash-decoding), so small batches of long sequences under-fill a big GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenloom.engine.attention.kernel_launch import KernelLaunch
from tokenloom.engine.attention.metadata import VarlenTables

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the fast path on GPUs
# Whether the kernels below were built for triton's CPU interpreter: triton decides when a kernel
# module is imported (TRITON_INTERPRET=1 in the environment), not when a kernel is launched.
RUNS_IN_INTERPRETER: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def _find_chunk(query_start_ptr, num_chunks, query_block, BLOCK_Q: tl.constexpr):
    """The chunk i whose query blocks [query_start[i] // BLOCK_Q + i, ...) contain `query_block`."""
    # Typed int32 from the start, so the loop-carried values keep one type through the loop.
    low: tl.int32 = 0
    high: tl.int32 = num_chunks
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= query_block:
            low = mid + 1
        else:
            high = mid
    return low - 1


# Which arguments triton may specialise a compiled variant on. By default it compiles one variant
# per class of each integer argument (equal to 1: a constant; a multiple of 16; other) and per
# pointer alignment (16 bytes or not). The step's chunk count, the block size, the sliding window
# and the block-table stride change from one step or engine to the next while the code they would
# specialise does not gain from it (a loop bound, scalar index arithmetic, the block-table rows the
# scalar loads read), and the step tables are scalar-loaded sections of one buffer whose
# alignment depends on max_num_seqs. Left specialised they multiply the variants of one layout by
# about 7 (each a first-time compile of ~1-2 s in the middle of a run: the CUDA graphs' batch sizes
# alone give chunk counts of 1, multiples of 16 and others); unspecialised, a layout, dtype and
# tile compile once. The strides and pointers of Q, K, V and the output stay specialised: fixed
# per model, their alignment lets head_dim loads vectorise.
# tests/bench/test_gpu_compile_variants.py counts the variants the device check compiles.
_UNSPECIALISED_INTS = ["num_chunks", "block_size", "sliding_window", "stride_table"]
_ALIGNMENT_FREE_TABLES = ["block_table_ptr", "query_start_ptr", "context_lens_ptr"]


@triton.jit(do_not_specialize=_UNSPECIALISED_INTS, do_not_specialize_on_alignment=_ALIGNMENT_FREE_TABLES)
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_chunks, max_blocks] int32
    query_start_ptr,  # [num_chunks + 1] int32
    context_lens_ptr,  # [num_chunks] int32
    num_chunks,
    block_size,
    sliding_window,
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    query_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = _find_chunk(query_start_ptr, num_chunks, query_block, BLOCK_Q)
    query_start = tl.load(query_start_ptr + chunk)
    query_len = tl.load(query_start_ptr + chunk + 1) - query_start
    first_query = (query_block - (query_start // BLOCK_Q + chunk)) * BLOCK_Q  # within the chunk
    if first_query >= query_len:
        return  # a spare block of the upper bound
    context_len = tl.load(context_lens_ptr + chunk)
    start_position = context_len - query_len  # position of the chunk's first query token

    rows = tl.arange(0, BLOCK_M)
    query_token = first_query + rows // GROUP  # [BLOCK_M] within the chunk
    head = kv_head * GROUP + rows % GROUP  # GQA: query head h reads KV head h // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_token < query_len)
    query_position = start_position + query_token
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM

    q_offsets = (query_start + query_token)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, D_P]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    last_query = tl.minimum(first_query + BLOCK_Q, query_len) - 1
    key_end = start_position + last_query + 1  # causal: nothing after the block's last query
    key_begin = 0
    if USE_WINDOW:  # keys older than the window of the block's FIRST query are never needed
        key_begin = tl.maximum(start_position + first_query - sliding_window + 1, 0)
    table_row = block_table_ptr + chunk.to(tl.int64) * stride_table
    for tile_start in range((key_begin // TILE_N) * TILE_N, key_end, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        key_valid = keys < key_end
        physical_block = tl.load(table_row + keys // block_size, mask=key_valid, other=0).to(tl.int64)
        row_in_block = keys % block_size
        k_offsets = physical_block * stride_kc_block + row_in_block * stride_kc_token + kv_head * stride_kc_head
        k = tl.load(
            key_cache_ptr + k_offsets[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [D_P, TILE_N]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N] fp32
        allowed = key_valid[None, :] & (keys[None, :] <= query_position[:, None])
        if USE_WINDOW:
            allowed = allowed & (query_position[:, None] - keys[None, :] < sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row with nothing allowed yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
        probs = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)

        v_offsets = physical_block * stride_vc_block + row_in_block * stride_vc_token + kv_head * stride_vc_head
        v = tl.load(
            value_cache_ptr + v_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE_N, D_P]
        if UPCAST_DOT:
            v = v.to(tl.float32)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    o_offsets = (query_start + query_token)[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    tables: VarlenTables,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query)
    paged_attention_launch(out, query, key_cache, value_cache, tables, scale, sliding_window).run()
    return out


def paged_attention_launch(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    tables: VarlenTables,
    scale: float,
    sliding_window: int | None,
) -> KernelLaunch:
    """The launch `paged_attention` runs, built without running it (tests compile it for sm_90)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    head_dim_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    tile = attention_tile(query.dtype, head_dim_p, group, tables.max_query_len)
    num_chunks = tables.context_lens.shape[0]
    args = (
        out,
        query,
        key_cache,
        value_cache,
        tables.block_table,
        tables.query_start,
        tables.context_lens,
        num_chunks,
        key_cache.shape[1],
        sliding_window or 0,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        tables.block_table.stride(0),
    )
    options = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        GROUP=group,
        BLOCK_Q=tile.block_q,
        BLOCK_M=tile.block_m,
        TILE_N=tile.tile_n,
        USE_WINDOW=sliding_window is not None,
        # fp32 models get true fp32 products (TF32 would drift from the torch reference).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # None: the backend default
        # triton 3.x's interpreter multiplies bfloat16 tiles as raw 16-bit integers (numpy has no
        # bfloat16): there, products are taken in fp32, which is what the GPU's fp32 accumulate gives.
        UPCAST_DOT=RUNS_IN_INTERPRETER and query.dtype == torch.bfloat16,
        num_warps=tile.num_warps,
    )
    grid = (num_tokens // tile.block_q + num_chunks, num_kv_heads)
    return KernelLaunch(_paged_attention_kernel, grid, args, options)


@dataclass(frozen=True, slots=True)
class AttentionTile:
    """How the kernel cuts a step: a program holds `block_m` rows (`block_q` query tokens times the
    GQA group, padded) of one KV head and walks their keys `tile_n` at a time with `num_warps` warps."""

    block_m: int
    block_q: int
    tile_n: int
    num_warps: int


def attention_tile(dtype: torch.dtype, head_dim_p: int, group: int, max_query_len: int) -> AttentionTile:
    """The tile for one step: the largest that sm_90 compiles without spilling registers.

    Rows: an all-decode step (every CUDA-graph replay) has one query per chunk, so the smallest
    tile that holds the head group (>= 16 rows for tl.dot) wastes the least. A step with prefill
    chunks takes 64-row tiles, so a long chunk is covered by few programs that each reuse every
    loaded K/V tile for many queries.

    Keys and warps: 16-bit tiles multiply on tensor cores. float32 tiles take the "ieee" dot, which
    runs on CUDA cores with Q, K, V and the accumulator held in registers: with 64 keys and 4 warps
    the 64-row prefill tile made ptxas spill (up to 47 KB of spill loads at head_dim 64-256, triton
    3.9, sm_90). So float32 prefill walks 16 keys at a time, with warps in proportion to head_dim
    (4 up to 64, 8 from 128; the registers a thread needs grow with head_dim / warps), and at
    head_dim 256 also halves the rows. Head dims above 128 take 32 keys and 8 warps in every other
    case (with 4 warps, float32 decode spilled 2 KB and 16-bit tiles a few bytes).
    tests/engine/attention/test_triton_compile.py compiles these tiles for sm_90 at the supported models'
    layouts and asserts no spills and shared memory within sm_90's limit.
    """
    smallest = max(16, triton.next_power_of_2(group))
    wide_head = head_dim_p > 128
    if max_query_len == 1:
        block_m = smallest
        tile_n, num_warps = (32, 8) if wide_head else (64, 4)
    elif dtype == torch.float32:
        block_m = max(32 if wide_head else 64, smallest)
        tile_n, num_warps = 16, (8 if head_dim_p >= 128 else 4)
    else:
        block_m = max(64, smallest)
        tile_n, num_warps = (32, 8) if wide_head else (64, 4)
    return AttentionTile(block_m, block_m // group, tile_n, num_warps)
