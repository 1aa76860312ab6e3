"""The Triton KV-write and paged-attention kernels equal the torch reference backend.

Random steps of awkward sizes: partial blocks, one-token sequences, prefill chunks over a cached
prefix, fragmented block tables, GQA ratios 1/2/4/7, head_dim 32/48/64/80/256, block sizes that do
not divide the kernel's key tile, sliding windows. Pool slots outside every context hold random
garbage, so a mask that lets one in shows up as a mismatch.

On a machine without CUDA the kernels run in triton's CPU interpreter (TRITON_INTERPRET=1, set
below before triton is imported); with CUDA they run compiled on the GPU (bench/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.attention.triton_steps import Step
from tests.engine.attention.triton_steps import make_step as make_step_on
from tests.engine.triton_support import DEVICE, require_kernel_runtime
from tokenloom.engine.attention.metadata import ChunkContext, VarlenTables
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.attention.triton_backend import TritonAttentionBackend
from tokenloom.engine.attention.triton_kv_write import write_kv

require_kernel_runtime()


def make_step(*args, **kwargs) -> Step:
    """A packed step (tests/engine/attention/triton_steps.py) on the device the kernels run on here."""
    return make_step_on(*args, device=DEVICE, **kwargs)


def assert_triton_matches_reference(step: Step, sliding_window: int | None = None, tolerance: float | None = None):
    scale = step.query.shape[-1] ** -0.5
    reference_caches = step.key_cache.clone(), step.value_cache.clone()
    expected = TorchAttentionBackend().forward(
        step.query, step.key, step.value, *reference_caches, step.metadata, scale, sliding_window
    )
    actual = TritonAttentionBackend().forward(
        step.query, step.key, step.value, step.key_cache, step.value_cache, step.metadata, scale, sliding_window
    )
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    # fp32: 1e-4, as SDPA and the tiled online softmax sum in different orders (on CUDA too); a
    # wrong mask moves outputs by ~0.1. Half types: their own rounding.
    tolerance = tolerance or 1e-4
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    # The kernel path wrote the new tokens' K/V exactly where index_copy_ put them.
    assert torch.equal(step.key_cache, reference_caches[0])
    assert torch.equal(step.value_cache, reference_caches[1])


DECODES = [(1, 1), (16, 1), (17, 1), (40, 1), (5, 1)]  # one-token sequence, full block, partial blocks


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (14, 2)])
@pytest.mark.parametrize("head_dim", [32, 48, 64])
def test_decode_batch_matches_reference_for_gqa_ratios_and_head_dims(num_heads, num_kv_heads, head_dim):
    step = make_step(DECODES, num_heads, num_kv_heads, head_dim, block_size=16, seed=head_dim + num_heads)
    assert_triton_matches_reference(step)


@pytest.mark.parametrize("block_size", [1, 5, 16, 128])
def test_mixed_step_matches_reference_for_any_block_size(block_size):
    # Decodes, a fresh prompt, a one-token prompt, and prefill chunks over cached prefixes.
    chunks = [(9, 1), (33, 1), (23, 23), (1, 1), (40, 7), (70, 20)]
    assert_triton_matches_reference(make_step(chunks, 8, 2, 48, block_size=block_size, seed=block_size))


def test_long_chunk_over_long_cached_prefix_matches_reference():
    # 90 queries span several query tiles; 300 keys span several key tiles and 19 pool blocks.
    step = make_step([(300, 90), (129, 1), (77, 1)], 8, 2, 80, block_size=16, seed=7)
    assert_triton_matches_reference(step)


@pytest.mark.parametrize("chunks", [[(33, 1), (5, 1)], [(33, 1), (40, 21)]], ids=["decode", "prefill"])
def test_head_dim_256_matches_reference_with_its_own_tiles(chunks):
    # Gemma 3's head size: fewer keys (and in fp32 prefill, fewer rows) per tile than head_dim <= 128.
    step = make_step(chunks, 4, 1, 256, block_size=16, seed=chunks[-1][0])
    assert_triton_matches_reference(step)


def test_metadata_built_without_tables_gets_them_from_its_chunks():
    # Like the start-up memory profile, which builds AttentionMetadata by hand.
    step = make_step([(30, 30), (12, 1)], 4, 2, 32, block_size=16, seed=11)
    step.metadata.tables = None
    assert_triton_matches_reference(step)
    assert step.metadata.tables is not None and step.metadata.tables.query_start.tolist() == [0, 30, 31]


@pytest.mark.parametrize("window", [1, 8, 40])
def test_sliding_window_masks_keys_older_than_the_window(window):
    chunks = [(50, 1), (7, 1), (30, 30), (64, 12)]
    step = make_step(chunks, 4, 2, 32, block_size=5, seed=window)
    assert_triton_matches_reference(step, sliding_window=window)
    # The window mattered: without it the same step gives a different answer.
    if window < 30:
        scale = 32**-0.5
        unwindowed = TorchAttentionBackend().forward(
            step.query,
            step.key,
            step.value,
            step.key_cache.clone(),
            step.value_cache.clone(),
            step.metadata,
            scale,
            None,
        )
        windowed = TritonAttentionBackend().forward(
            step.query, step.key, step.value, step.key_cache, step.value_cache, step.metadata, scale, window
        )
        assert not torch.allclose(unwindowed, windowed, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference_within_rounding(dtype):
    step = make_step([(20, 1), (45, 13), (8, 8)], 4, 2, 64, block_size=16, dtype=dtype, seed=3)
    assert_triton_matches_reference(step, tolerance=2e-2)


def test_kv_write_scatters_noncontiguous_values_like_index_copy():
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 3 * 2 * 48, generator=generator).to(DEVICE)
    # Like the model's fused projection: views into one wide row, not contiguous per tensor.
    key = qkv[:, 96:192].view(6, 2, 48)
    value = qkv[:, 192:].view(6, 2, 48)
    assert not value.is_contiguous()
    key_cache = torch.zeros(4, 5, 2, 48, device=DEVICE)
    value_cache = torch.zeros(4, 5, 2, 48, device=DEVICE)
    slots = torch.tensor([19, 0, 7, 4, 5, 12], device=DEVICE)
    write_kv(key, value, key_cache, value_cache, slots)
    expected_key = torch.zeros(20, 2, 48, device=DEVICE).index_copy_(0, slots, key)
    expected_value = torch.zeros(20, 2, 48, device=DEVICE).index_copy_(0, slots, value)
    assert torch.equal(key_cache.flatten(0, 1), expected_key)
    assert torch.equal(value_cache.flatten(0, 1), expected_value)


def test_kv_write_skips_tokens_with_negative_slot():
    key = torch.ones(3, 1, 16, device=DEVICE)
    key_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    value_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    write_kv(key, key * 2, key_cache, value_cache, torch.tensor([-1, 3, -1], device=DEVICE))
    written = key_cache.flatten(0, 1)[:, 0, 0]  # [8]
    assert written.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    assert value_cache.flatten(0, 1)[3, 0, 0].item() == 2 and value_cache.sum().item() == 2 * 16


def test_varlen_tables_pad_block_tables_and_count_queries():
    chunks = [ChunkContext(0, 1, 5, [7, 2], None), ChunkContext(1, 3, 3, [4], 64)]
    tables = VarlenTables.build(chunks, DEVICE)
    assert tables.query_start.tolist() == [0, 1, 4]
    assert tables.context_lens.tolist() == [5, 3]
    assert tables.block_table.tolist() == [[7, 2], [4, 0]]
    assert tables.max_query_len == 3 and tables.block_table.dtype == torch.int32
