"""tokenloom's C++ CPU kernels (engine/cpu/csrc) against the torch reference they replace.

The decode kernel is compared with the torch backend's attention over the same pool (shuffled,
non-contiguous block tables, GQA groups 1/3/7, head sizes 48/64/128, block sizes 1/5/16, sliding
windows, few and many sequences: both ways the kernel splits work). The fused layer ops are
compared with TorchLayerOps: float32 to rounding, bfloat16 RoPE and SwiGLU inputs bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.bit_patterns import assert_same_bits_up_to_subnormal_flush, every_16_bit_value
from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.cpu.kernels import load_cpu_kernels
from tokenloom.engine.cpu.layer_ops import CpuLayerOps
from tokenloom.engine.models.layer_ops import TorchLayerOps

load_cpu_kernels()
DECODE = torch.ops.tokenloom_cpu.paged_decode_attention


def _decode_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, max_context=90):
    """A pool with `num_seqs` contexts on shuffled blocks, their decode queries and tables."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [rng.randint(1, max_context) for _ in range(num_seqs)]
    blocks_needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_needed) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    chunks, start = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_needed)):
        chunks.append(ChunkContext(i, 1, n, order[start : start + nb], None))
        start += nb
    query = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    return query, key_cache, value_cache, chunks


def _reference_decode(query, key_cache, value_cache, chunks, scale, window):
    """The torch backend's attention for the same decodes (its write_kv skipped: nothing new)."""
    backend = TorchAttentionBackend()
    metadata = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(chunks), chunks=chunks)
    f32 = [t.float() for t in (query, key_cache, value_cache)]
    empty = torch.empty(0, key_cache.shape[2], key_cache.shape[3])
    backend.write_kv = lambda *args: None
    return backend.forward(f32[0], empty, empty, f32[1], f32[2], metadata, scale, window)


CASES = [
    # num_seqs, heads, kv_heads, head_dim, block_size, window
    (3, 9, 3, 64, 16, None),  # few sequences: heads split across items
    (12, 9, 3, 64, 16, None),  # many: one item per sequence, whole slots
    (12, 8, 8, 48, 5, None),  # MHA, head_dim not a power of two, odd block size
    (2, 7, 1, 128, 1, None),  # group of 7 (Qwen2.5-0.5B's), one-token blocks
    (10, 4, 2, 64, 16, 24),  # sliding window shorter than most contexts
    (3, 4, 2, 32, 4, 7),
]


@pytest.mark.parametrize("num_seqs,heads,kv_heads,head_dim,block_size,window", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_kernel_matches_torch_reference(num_seqs, heads, kv_heads, head_dim, block_size, window, dtype):
    query, key_cache, value_cache, chunks = _decode_case(
        num_seqs, heads, kv_heads, head_dim, block_size, dtype, seed=num_seqs + head_dim
    )
    scale = head_dim**-0.5
    tables = VarlenTables.build(chunks, torch.device("cpu"))
    out = torch.full_like(query, float("nan"))
    DECODE(out, query, key_cache, value_cache, tables.block_table, tables.context_lens, scale, window or 0)
    expected = _reference_decode(query, key_cache, value_cache, chunks, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_decode_kernel_reads_strided_queries_and_writes_strided_outputs():
    """The backend passes a slice of the packed step (rows of a wider tensor) straight in."""
    query, key_cache, value_cache, chunks = _decode_case(5, 6, 2, 64, 8, torch.float32, seed=3)
    wide = torch.randn(5, 10, 64)
    wide[:, 2:8] = query
    out_wide = torch.zeros(5, 10, 64)
    tables = VarlenTables.build(chunks, torch.device("cpu"))
    DECODE(out_wide[:, 2:8], wide[:, 2:8], key_cache, value_cache, tables.block_table, tables.context_lens, 0.125, 0)
    torch.testing.assert_close(out_wide[:, 2:8], _reference_decode(query, key_cache, value_cache, chunks, 0.125, None))
    assert out_wide[:, :2].abs().sum() == 0 and out_wide[:, 8:].abs().sum() == 0  # nothing outside the view


def test_decode_kernel_refuses_mismatched_inputs_with_a_message():
    query, key_cache, value_cache, chunks = _decode_case(2, 4, 2, 64, 8, torch.float32, seed=1)
    tables = VarlenTables.build(chunks, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="int32"):
        DECODE(
            torch.empty_like(query),
            query,
            key_cache,
            value_cache,
            tables.block_table.long(),
            tables.context_lens,
            1.0,
            0,
        )
    with pytest.raises(RuntimeError, match="one dtype"):
        DECODE(
            torch.empty_like(query),
            query.double(),
            key_cache,
            value_cache,
            tables.block_table,
            tables.context_lens,
            1.0,
            0,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_ops_match_the_torch_reference(dtype):
    torch.manual_seed(0)
    cpu, ref = CpuLayerOps(), TorchLayerOps()
    tokens, hidden_size, heads, kv_heads, head_dim = 37, 96, 6, 2, 16
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    one_ulp = dict(atol=1e-5, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)

    hidden = torch.randn(tokens, hidden_size).to(dtype)
    residual = torch.randn(tokens, hidden_size).to(dtype)
    weight = (torch.rand(hidden_size) + 0.5).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(hidden, weight, 1e-5), ref.rms_norm(hidden, weight, 1e-5), **one_ulp)
    expected_normed, expected_residual = ref.add_rms_norm(hidden, residual, weight, 1e-5)
    normed, new_residual = cpu.add_rms_norm(hidden.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_residual, **exact)
    torch.testing.assert_close(normed, expected_normed, **one_ulp)

    # RoPE on the strided q/k views a fused qkv projection yields.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = ref.rotary(q, k, cos, sin)
    rotated_q, rotated_k = cpu.rotary(q, k, cos, sin)
    torch.testing.assert_close(rotated_q, expected_q, **exact)
    torch.testing.assert_close(rotated_k, expected_k, **exact)

    gate_up = torch.randn(tokens, 2 * hidden_size).to(dtype)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **one_ulp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_is_torchs_for_every_16_bit_gate_value(dtype):
    """Every one of the 65,536 bit patterns as a gate, against random ups: torch's silu times up,
    bit for bit (the kernel looks silu up in a table torch computed), infinities and NaNs included.
    A subnormal product may come out as zero (a thread that flushes subnormals)."""
    torch.manual_seed(0)
    gate = every_16_bit_value(dtype, 32)
    up = torch.randn(32, 2048).to(dtype)
    gate_up = torch.cat([gate, up], dim=1)
    with torch.inference_mode():
        fused = CpuLayerOps().silu_and_mul(gate_up)
        expected = TorchLayerOps().silu_and_mul(gate_up)
    assert_same_bits_up_to_subnormal_flush(fused, expected, gate, torch.finfo(dtype).tiny)
