"""The packed KV layout (engine/cpu/csrc/packed_kv_layout.h) and the kernel that attends over it.

Kernel, for bfloat16 and float32 pools: the writer puts each value where the layout header says;
attention over pools filled with NaN bits outside the written slots equals a float32 reference
(GQA 1/2/3/7/8/16, head sizes 32/64/128, block sizes 16/32, decodes and prefill chunks in one
call, chunks over cached context, sliding windows, few decodes split by kv head and many taken
whole). On a CPU with AVX512-BF16 the bfloat16 cases run vdpbf16ps, on other AVX-512 CPUs the
widened float32 FMAs: each machine tests the path it runs. Engine, on the packed pool under
chunked prefill, prefix caching, preemption and swap: a float32 model's greedy tokens equal
transformers' greedy generate() exactly; a bfloat16 model picks tokens that transformers' bfloat16
forward over the same sequence ranks first (up to bfloat16 rounding), with logprobs that match
it: a wrong mask, slot or block would pick tokens far from its top.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import engine_config
from tests.engine.cpu_support import NO_PACKED_KV, packed_kv_supported
from tokenloom.engine.attention.metadata import ChunkContext, VarlenTables
from tokenloom.engine.cpu.attention_backend import CpuAttentionBackend
from tokenloom.engine.cpu.kernels import load_cpu_kernels
from tokenloom.engine.cpu.linear import float32_uses_mkl
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams

load_cpu_kernels()
OPS = torch.ops.tokenloom_cpu
pytestmark = [pytest.mark.skipif(not packed_kv_supported(), reason=NO_PACKED_KV), pytest.mark.slow]
DTYPES = [torch.bfloat16, torch.float32]


def _pools(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16):
    """NaN bits everywhere: only written slots may ever reach an output."""
    return (torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_writer_puts_each_value_where_the_layout_says(dtype):
    block_size, kv_heads, head_dim = 16, 2, 8
    key_cache, value_cache = _pools(3, block_size, kv_heads, head_dim, dtype)
    key = torch.arange(2 * kv_heads * head_dim, dtype=dtype).view(2, kv_heads, head_dim)
    value = -key
    OPS.write_packed_kv(key, value, key_cache, value_cache, torch.tensor([2 * block_size + 5, 2 * block_size + 6]))
    tile_elems = block_size * head_dim  # values per (block, kv head) tile
    k_flat, v_flat = key_cache.view(-1), value_cache.view(-1)
    for token, slot in ((0, 5), (1, 6)):
        for head in range(kv_heads):
            tile = (2 * kv_heads + head) * tile_elems
            for d in range(head_dim):
                if dtype == torch.bfloat16:
                    # K: word (pair d // 2, slot) holds dims 2p, 2p+1; V: word (slot pair, dim) holds slots 2j, 2j+1
                    k_at, v_at = 2 * ((d // 2) * block_size + slot) + d % 2, 2 * ((slot // 2) * head_dim + d) + slot % 2
                else:  # K: [dim][slot], V: [slot][dim]
                    k_at, v_at = d * block_size + slot, slot * head_dim + d
                assert k_flat[tile + k_at] == key[token, head, d]
                assert v_flat[tile + v_at] == value[token, head, d]


def _case(specs, heads, kv_heads, head_dim, block_size, seed=0, dtype=torch.bfloat16):
    """Chunks (start position, query tokens) with their contexts written into shuffled blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [start + n for start, n in specs]
    needed = [-(-n // block_size) for n in lens]
    order = list(range(sum(needed) + 2))
    rng.shuffle(order)
    key_cache, value_cache = _pools(len(order), block_size, kv_heads, head_dim, dtype)
    chunks, contexts, query_start, used = [], [], 0, 0
    for (start, n), length, count in zip(specs, lens, needed):
        blocks = order[used : used + count]
        used += count
        chunks.append(ChunkContext(query_start, n, length, blocks, None))
        query_start += n
        k, v = (torch.randn(length, kv_heads, head_dim).to(dtype) for _ in range(2))
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        OPS.write_packed_kv(k, v, key_cache, value_cache, slots)
        contexts.append((k, v))
    query = torch.randn(query_start, heads, head_dim).to(dtype)
    return query, key_cache, value_cache, chunks, contexts


def _reference(query, chunks, contexts, scale, window):
    out = torch.zeros(query.shape)
    for chunk, (k, v) in zip(chunks, contexts):
        group = query.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        rows = slice(chunk.query_start, chunk.query_start + chunk.num_query_tokens)
        scores = torch.einsum("qhd,khd->hqk", query[rows].float(), k) * scale
        query_pos = torch.arange(chunk.num_query_tokens)[:, None] + chunk.start_position
        key_pos = torch.arange(chunk.context_len)[None, :]
        visible = key_pos <= query_pos
        if window:
            visible &= key_pos > query_pos - window
        out[rows] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


CASES = [
    # chunks (start, query tokens), heads, kv_heads, head_dim, block_size, window
    ([(0, 40)], 9, 3, 64, 16, None),  # one prompt, several query tiles
    ([(30, 1), (100, 1), (0, 100), (37, 20)], 9, 3, 64, 16, None),  # decodes + a prompt + a chunk over cache
    ([(5, 33), (0, 17), (60, 1)], 8, 8, 32, 32, None),  # MHA, 32-slot blocks
    ([(0, 50), (20, 30), (200, 1)], 7, 1, 128, 16, None),  # a group of 7
    ([(0, 70), (40, 25), (90, 1), (33, 1)], 4, 2, 64, 16, 24),  # sliding window
    ([(14, 1), (15, 1), (16, 1), (0, 1)], 9, 3, 64, 16, 5),  # odd/even context ends, window edges
    # 12+ decodes: each decode is one item over every kv head (a dense walk through its blocks)
    ([(i * 7 % 90, 1) for i in range(12)] + [(3, 20)], 9, 3, 64, 16, None),
    ([(i * 11 % 90, 1) for i in range(12)] + [(3, 20)], 9, 3, 64, 16, 7),
    ([(i * 5 % 90, 1) for i in range(12)], 8, 1, 128, 32, None),  # a group of 8
    ([(i * 13 % 90, 1) for i in range(12)], 8, 8, 32, 16, 20),
    ([(i * 3 % 90, 1) for i in range(12)], 16, 1, 64, 16, None),  # a group of 16: split by head instead
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("specs,heads,kv_heads,head_dim,block_size,window", CASES)
def test_packed_attention_matches_a_float32_reference(specs, heads, kv_heads, head_dim, block_size, window, dtype):
    query, key_cache, value_cache, chunks, contexts = _case(specs, heads, kv_heads, head_dim, block_size, dtype=dtype)
    tables = VarlenTables.build(chunks, torch.device("cpu"))
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    OPS.packed_paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        tables.query_start,
        tables.block_table,
        tables.context_lens,
        scale,
        window or 0,
    )
    expected = _reference(query, chunks, contexts, scale, window)
    if dtype == torch.bfloat16:  # bfloat16 output and probabilities: about 2-3 bfloat16 ulps of values of size ~1
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    else:  # float32 throughout: only the summation order differs from the reference
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_packed_kernels_refuse_unsupported_pools_with_a_message():
    query, key_cache, value_cache, chunks, _ = _case([(0, 4)], 4, 2, 64, 16)
    tables = VarlenTables.build(chunks, torch.device("cpu"))
    args = (tables.query_start, tables.block_table, tables.context_lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="all of one dtype"):
        OPS.packed_paged_attention(query.float(), query.float(), key_cache, value_cache, *args)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        OPS.packed_paged_attention(query.half(), query.half(), key_cache.half(), value_cache.half(), *args)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.packed_paged_attention(query, query, key_cache.view(-1, 8, 2, 64), value_cache.view(-1, 8, 2, 64), *args)
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.write_packed_kv(query[:1, :2], query[:1, :2], key_cache, value_cache, torch.tensor([10**6]))


def test_the_cpu_backend_packs_only_pools_it_has_kernels_for():
    backend = CpuAttentionBackend()
    assert backend.uses_packed_layout(torch.empty(2, 16, 2, 64, dtype=torch.bfloat16))
    assert backend.uses_packed_layout(torch.empty(2, 32, 1, 128, dtype=torch.bfloat16))
    assert backend.uses_packed_layout(torch.empty(2, 16, 2, 32, dtype=torch.float32))
    assert not backend.uses_packed_layout(torch.empty(2, 16, 2, 64, dtype=torch.float16))  # dtype
    assert not backend.uses_packed_layout(torch.empty(2, 8, 2, 64, dtype=torch.bfloat16))  # block size
    assert not backend.uses_packed_layout(torch.empty(2, 16, 2, 48, dtype=torch.bfloat16))  # head size


# --- the engine on a packed pool ---------------------------------------------------------------------

ENGINE_SCENARIOS = {
    "chunked_prefill": dict(scheduler=dict(max_num_batched_tokens=24, max_num_seqs=16)),
    "prefix_cache": dict(scheduler=dict(max_num_batched_tokens=128, max_num_seqs=8)),
    "preemption": dict(
        kv_cache=dict(num_blocks=12, enable_prefix_caching=False, swap_space_gb=0.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=12),
    ),
    "swap": dict(
        kv_cache=dict(num_blocks=12, enable_prefix_caching=False, swap_space_gb=1.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=12),
    ),
}


@pytest.fixture(scope="module")
def packed_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packed")
    shape = dict(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=256,
        initializer_range=0.1,
    )  # head_dim 32
    return {
        "llama": build_random_checkpoint(root / "llama", "LlamaForCausalLM", seed=3, **shape),
        "mistral": build_random_checkpoint(root / "mistral", "MistralForCausalLM", seed=4, sliding_window=24, **shape),
    }


def _prompts(seed: int, shared_prefix: bool) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 384) for _ in range(40)] for _ in range(3)]
    prompts = []
    for i in range(12):
        head = prefixes[i % 3] if shared_prefix else [1]
        prompts.append((head + [rng.randrange(3, 384) for _ in range(rng.randint(1, 60))], rng.randint(8, 24)))
    return prompts


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("scenario", list(ENGINE_SCENARIOS))
def test_bfloat16_engine_on_a_packed_pool_agrees_with_transformers(family, scenario, packed_checkpoints):
    checkpoint = packed_checkpoints[family]
    config = engine_config(checkpoint, model=dict(max_model_len=128, dtype="bfloat16"), **ENGINE_SCENARIOS[scenario])
    engine = Engine(config)
    assert engine.backend.uses_packed_layout(engine.runner.kv_caches[0][0])
    prompts = _prompts(seed=len(family), shared_prefix=scenario == "prefix_cache")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for _, n in prompts]
    outputs = engine.generate([p for p, _ in prompts], params)
    if scenario in ("preemption", "swap"):
        assert engine.counters.num_preemptions > 0
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    worst_gap, worst_logprob_error = 0.0, 0.0
    for (prompt, _), output in zip(prompts, outputs):
        generated = output.outputs[0].token_ids
        with torch.no_grad():  # transformers' view of the very sequence the engine wrote
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(generated)
        chosen_logits = logits.gather(1, chosen[:, None])[:, 0]
        worst_gap = max(worst_gap, (logits.max(1).values - chosen_logits).max().item())
        expected_logprobs = logits.log_softmax(1).gather(1, chosen[:, None])[:, 0]
        engine_logprobs = torch.tensor([lp.logprob for lp in output.outputs[0].logprobs])
        worst_logprob_error = max(worst_logprob_error, (engine_logprobs - expected_logprobs).abs().max().item())
    print(f"{family} {scenario}: worst gap {worst_gap:.4f}, worst logprob error {worst_logprob_error:.4f}")
    # Each pick is transformers' top token or within bfloat16 noise of it (logits here are ~1-5).
    assert worst_gap < 0.1, f"a token {worst_gap:.3f} below transformers' best logit"
    assert worst_logprob_error < 0.1, f"logprobs differ from transformers' by up to {worst_logprob_error:.3f}"


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("scenario", list(ENGINE_SCENARIOS))
def test_float32_engine_on_a_packed_pool_picks_transformers_greedy_tokens(family, scenario, packed_checkpoints):
    """Exact in float32: every engine token is the argmax of transformers' forward over the same sequence.

    The reference is the full forward, not generate(): for the sliding-window Mistral, transformers'
    generate() with its cache picks differently from its own full forward once a sequence passes
    the window (seen here: prompt 10 of the chunked-prefill set, where the forward prefers the
    engine's token by 0.196), and the torch reference backend agrees with the forward too.
    """
    checkpoint = packed_checkpoints[family]
    config = engine_config(checkpoint, model=dict(max_model_len=128, dtype="float32"), **ENGINE_SCENARIOS[scenario])
    engine = Engine(config)
    assert engine.backend.uses_packed_layout(engine.runner.kv_caches[0][0])
    prompts = _prompts(seed=len(family), shared_prefix=scenario == "prefix_cache")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in prompts]
    outputs = engine.generate([p for p, _ in prompts], params)
    if scenario in ("preemption", "swap"):
        assert engine.counters.num_preemptions > 0
    if scenario == "prefix_cache":
        assert engine.counters.prefix_cache_hits > 0
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for i, ((prompt, _), output) in enumerate(zip(prompts, outputs)):
        generated = output.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(1).tolist() == generated, f"prompt #{i}: not transformers' greedy tokens"


def test_the_start_up_report_names_the_kernels_the_pool_gets(packed_checkpoints, stories260k):
    packed = Engine(engine_config(packed_checkpoints["llama"], model=dict(max_model_len=128)))
    assert "attention backend cpu (packed KV layout, float32 FMAs)" in packed.startup_report
    gemm = "MKL's packed GEMM" if float32_uses_mkl() else "oneDNN"
    assert re.search(rf"linear layers packed at load: \d+ for {re.escape(gemm)}", packed.startup_report)
    plain = Engine(engine_config(stories260k, model=dict(max_model_len=128)))  # head size 8
    assert "attention backend cpu (plain KV layout: head size 8 (packed kernels: 32/64/128))" in plain.startup_report


def test_the_start_up_report_says_when_prefill_chunks_run_on_amx_tiles():
    backend = CpuAttentionBackend()
    pool16, pool32 = (torch.empty(2, size, 3, 64, dtype=torch.bfloat16) for size in (16, 32))
    amx = (
        backend.uses_packed_layout(pool16)
        and torch.ops.tokenloom_cpu.packed_kv_bf16_dot()
        and torch.ops.tokenloom_cpu.packed_prefill_amx()
    )
    assert ("prefill chunks on AMX tiles" in backend.describe(pool16)) == amx
    assert "AMX" not in backend.describe(pool32)  # the AMX path reads 16-slot blocks only
