"""Mixture-of-experts families (Qwen3-MoE, Mixtral) through the whole engine, against transformers.

The greedy-oracle scenarios of tests/engine/oracle_scenarios.py (chunked prefill mixed with
decode, preemption by recompute and by swap, prefix caching) on random-initialised checkpoints
whose routers send the tokens of one step to many different experts (asserted below, from the
routing the engine's own forward records).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.conftest import ORACLE_CONFIG, engine_config
from tests.engine.oracle_scenarios import (
    SCENARIOS,
    mixed_prompts,
    prompt_kind,
    run_scenario,
    shared_prefix_prompts,
    transformers_reference,
)
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.models.moe import RoutedExperts
from tokenloom.engine.runner.model_setup import startup_report
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

MOE_FAMILIES = {
    # 3 layers, layer 1 dense (mlp_only_layers), per-head q/k norms: every Qwen3-MoE feature.
    "qwen3_moe": dict(
        architecture="Qwen3MoeForCausalLM",
        num_hidden_layers=3,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(
        architecture="MixtralForCausalLM",
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=48,
    ),
}
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_checkpoints")
    return {
        name: build_random_checkpoint(root / name, seed=10 + i, **ORACLE_CONFIG, **spec)
        for i, (name, spec) in enumerate(MOE_FAMILIES.items())
    }


@pytest.fixture(scope="module")
def references(moe_checkpoints):
    cache = {}

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            seed = 100 + len(family)
            prompts = shared_prefix_prompts(seed) if kind == "prefix" else mixed_prompts(seed)
            cache[family, kind] = (prompts, transformers_reference(moe_checkpoints[family], prompts))
        return cache[family, kind]

    return get


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_transformers_generate(family, scenario, backend, moe_checkpoints, references):
    prompts, expected = references(family, prompt_kind(scenario))
    engine = run_scenario(moe_checkpoints[family], scenario, backend, prompts, expected)
    assert any(isinstance(layer.mlp, RoutedExperts) for layer in engine.loaded.model.layers)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_one_step_routes_its_tokens_to_many_different_experts(family, moe_checkpoints):
    engine = Engine(engine_config(moe_checkpoints[family], model=dict(max_model_len=128)))
    routed = [
        (i, layer.mlp) for i, layer in enumerate(engine.loaded.model.layers) if isinstance(layer.mlp, RoutedExperts)
    ]
    first_forward: dict[int, torch.Tensor] = {}
    calls = defaultdict(int)

    def record(layer_index):
        def hook(_module, _inputs, routing):
            calls[layer_index] += 1
            first_forward.setdefault(layer_index, routing.expert_ids.clone())  # [num_tokens, top_k]

        return hook

    handles = [moe.router.register_forward_hook(record(i)) for i, moe in routed]
    try:
        prompts, _ = mixed_prompts(seed=7)[:8], None
        engine.generate([p for p, _ in prompts], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        for handle in handles:
            handle.remove()
    assert set(first_forward) == {i for i, _ in routed} and all(calls[i] > 1 for i, _ in routed)
    for layer_index, expert_ids in first_forward.items():
        assert expert_ids.shape[0] > 8 and expert_ids.shape[1] == 2  # a prefill step of several prompts, top-2
        used = expert_ids.unique()
        pairs = {tuple(sorted(row)) for row in expert_ids.tolist()}
        assert len(used) >= NUM_EXPERTS // 2, f"layer {layer_index}: one step used only experts {used.tolist()}"
        assert len(pairs) >= 4, f"layer {layer_index}: tokens share too few expert pairs ({pairs})"
        assert all(a != b for a, b in expert_ids.tolist())


def test_startup_report_names_the_family_and_the_python_loop_fallback(moe_checkpoints):
    engine = Engine(engine_config(moe_checkpoints["qwen3_moe"], model=dict(max_model_len=128, attention_backend="cpu")))
    engine.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=2))
    report = startup_report(engine.loaded, engine.kv_plan, engine.backend.name)
    assert "Qwen3-MoE: 8 experts, top-2, normalised" in report
    assert "2 of 3 layers routed (1 dense)" in report
    assert "Python loop" in report
    assert engine.loaded.model._stack is None  # the C++ decoder stack is not used for a MoE model


def test_int8_quantizes_the_dense_linears_and_keeps_experts_in_the_model_dtype(moe_checkpoints):
    config = engine_config(moe_checkpoints["qwen3_moe"], model=dict(max_model_len=128)).replace(
        "quantization", enabled=True, method="int8"
    )
    engine = Engine(config)
    report = engine.loaded.quantization
    # qkv and o in each of 3 layers, plus gate_up and down of the one dense layer
    assert report.quantized_layers + len(report.kept) == 3 * 2 + 2 and report.quantized_layers > 0
    experts = [layer.mlp for layer in engine.loaded.model.layers if isinstance(layer.mlp, RoutedExperts)]
    assert all(e.gate_up_proj.dtype == e.down_proj.dtype == e.router.weight.dtype == torch.float32 for e in experts)
    assert "experts and routers stay float32" in startup_report(engine.loaded, engine.kv_plan, engine.backend.name)
    outputs = engine.generate([[1, 5, 9, 33], [1, 40]], SamplingParams(temperature=0.0, max_tokens=6))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
