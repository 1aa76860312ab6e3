"""A float32 KV pool under a half-precision model on CPU with the torch backend (engine/runner/device.py
kv_cache_dtype); the C++ CPU backend keeps the model's dtype."""

from __future__ import annotations

import torch

from tests.conftest import engine_config
from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.device import kv_cache_dtype
from tokenloom.engine.sample.sampling_params import SamplingParams


def test_only_half_precision_on_cpu_under_the_torch_backend_gets_a_float32_pool():
    assert kv_cache_dtype(torch.float32, torch.device("cpu"), "torch") is torch.float32
    assert kv_cache_dtype(torch.bfloat16, torch.device("cuda"), "triton") is torch.bfloat16
    assert kv_cache_dtype(torch.bfloat16, torch.device("cpu"), "torch") is torch.float32
    assert kv_cache_dtype(torch.float16, torch.device("cpu"), "torch") is torch.float32
    assert kv_cache_dtype(torch.bfloat16, torch.device("cpu"), "cpu") is torch.bfloat16


def _step(dtype, cache_dtype):
    """A prefill of 5 tokens over 3 cached ones plus a decode, through the torch backend."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    key_cache = torch.randn(8, block_size, kv_heads, head_dim).to(cache_dtype)
    value_cache = torch.randn(8, block_size, kv_heads, head_dim).to(cache_dtype)
    q, k, v = (torch.randn(6, n, head_dim).to(dtype) for n in (heads, kv_heads, kv_heads))
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([25, 3, 4, 5, 6, 7]),
        num_decodes=1,
        chunks=[ChunkContext(0, 1, 10, [4, 5, 6], None), ChunkContext(1, 5, 8, [0, 1], 0)],
    )
    return TorchAttentionBackend().forward(q, k, v, key_cache, value_cache, metadata, head_dim**-0.5, None)


def test_float32_pool_attends_in_float32_and_returns_the_model_dtype():
    mixed = _step(torch.bfloat16, torch.float32)
    reference = _step(torch.float32, torch.float32)  # inputs are bf16-rounded in `mixed` only
    assert mixed.dtype is torch.bfloat16
    torch.testing.assert_close(mixed.float(), reference, atol=0.05, rtol=0.05)


def test_bfloat16_engine_with_a_float32_pool_generates(llama_checkpoint):
    engine = Engine(engine_config(llama_checkpoint).replace("model", dtype="bfloat16", attention_backend="torch"))
    assert engine.kv_dtype is torch.float32 and engine.runner.kv_caches[0][0].dtype is torch.float32
    assert "float32: CPU attention is faster" in engine.startup_report
    out = engine.generate(["a b c", "hello"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
