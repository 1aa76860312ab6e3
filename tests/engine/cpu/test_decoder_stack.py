"""The C++ layer loop (engine/cpu/decoder_stack.py): which models take it, and that it is the
Python loop bit for bit, so the greedy oracle's checks of that loop against transformers
(tests/engine/oracle/test_greedy_oracle.py) carry over to it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import FAMILIES, ORACLE_CONFIG, engine_config
from tests.engine.cpu_support import onednn_bfloat16_or_skip, packed_kv_or_skip
from tokenloom.engine.cpu import decoder_stack
from tokenloom.engine.cpu import linear as cpu_linear
from tokenloom.engine.cpu.linear import mkl_packing_available
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"),
    pytest.mark.slow,
]

PROMPT_LENGTHS = (3, 17, 40, 9, 61)  # several chunks per step, prefills split across steps


@pytest.fixture(scope="module")
def packed_checkpoints(tmp_path_factory) -> dict:
    """The shared families with head_dim 32: the packed KV layout's smallest head (the stack runs
    only on that layout; the shared fixtures' head_dim 16 keeps the plain one)."""
    root = tmp_path_factory.mktemp("packed")
    return {
        family: _with_random_norm_weights(
            build_random_checkpoint(root / family, seed=i, **{**ORACLE_CONFIG, **FAMILIES[family], "head_dim": 32})
        )
        for i, family in enumerate(("llama", "mistral", "qwen2", "qwen3"))
    }


def _with_random_norm_weights(checkpoint):
    """RMSNorm weights start at one: make each norm distinct, so a norm applied with another's weight shows."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    model.save_pretrained(checkpoint)
    return checkpoint


def _engine(checkpoint, dtype: str) -> Engine:
    # 32 tokens per step: prefill chunks split across steps and share steps with decodes.
    return Engine(
        engine_config(
            checkpoint,
            scheduler=dict(max_num_batched_tokens=32, max_num_seqs=4),
            kv_cache=dict(enable_prefix_caching=False),
        ).replace("model", dtype=dtype)
    )


def _run(checkpoint, dtype: str, enabled: bool, monkeypatch):
    """(tokens, chosen-token logprobs, the KV pool, whether the stack ran) of one greedy batch."""
    monkeypatch.setattr(decoder_stack, "ENABLED", enabled)
    engine = _engine(checkpoint, dtype)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.runner.model.shape.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0)
    outputs = engine.generate(prompts, params)
    assert all(o.error is None for o in outputs)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[entry.logprob for entry in o.outputs[0].logprobs] for o in outputs]
    used = engine.runner.model._stack is not None
    assert ("decoder layers in one C++ call" in engine.startup_report) == used
    return tokens, logprobs, engine.runner.pool.clone(), used


@pytest.fixture(params=["float32-mkl", "float32-onednn", "bfloat16"])
def dtype_and_kernel(request, monkeypatch) -> str:
    """Each linear kind the stack serves, on every CPU (the engine picks the float32 one by vendor)."""
    dtype, _, gemm = request.param.partition("-")
    if gemm == "mkl" and not mkl_packing_available():
        pytest.skip("this torch has no MKL packed GEMM: float32 layers use oneDNN (the float32-onednn case)")
    if dtype == "bfloat16":
        onednn_bfloat16_or_skip()
    monkeypatch.setattr(cpu_linear, "FLOAT32_GEMM", gemm or None)
    monkeypatch.setattr(cpu_linear, "brgemm_fast", lambda: False)  # AMX's brgemm layers keep the Python loop
    return dtype


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])  # + sliding window, q/k/v biases, q/k norms
def test_the_stack_equals_the_python_loop_bit_for_bit(family, dtype_and_kernel, packed_checkpoints, monkeypatch):
    packed_kv_or_skip()  # the stack serves packed pools only; plain ones keep the Python loop
    checkpoint = packed_checkpoints[family]
    tokens, logprobs, pool, used = _run(checkpoint, dtype_and_kernel, True, monkeypatch)
    assert used, "the CPU backend should run this model through the C++ stack"
    loop_tokens, loop_logprobs, loop_pool, loop_used = _run(checkpoint, dtype_and_kernel, False, monkeypatch)
    assert not loop_used
    assert tokens == loop_tokens
    assert logprobs == loop_logprobs  # the logits, not just their argmax
    assert torch.equal(pool.view(torch.uint8), loop_pool.view(torch.uint8))  # every layer's K and V


def test_models_outside_the_stack_keep_the_python_loop(packed_checkpoints, family_checkpoints, monkeypatch):
    monkeypatch.setattr(decoder_stack, "ENABLED", True)
    torch_backend = Engine(engine_config(packed_checkpoints["llama"], model=dict(attention_backend="torch")))
    plain_layout = Engine(engine_config(family_checkpoints["llama"]))  # head_dim 16: the plain KV layout
    for engine in (torch_backend, plain_layout):
        out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3 and engine.runner.model._stack is None
        assert "decoder layers in one C++ call" not in engine.startup_report
