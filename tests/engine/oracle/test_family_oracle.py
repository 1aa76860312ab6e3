"""Gemma 3 (text) and Phi-3/Phi-4 through everything the engine does, against transformers.

Each family's random-initialised checkpoint (saved with `save_pretrained`, norm weights made
distinct) runs the shared greedy-oracle scenarios (tests/engine/oracle_scenarios.py: chunked
prefill mixed with decodes, preemption by recompute and by swap, prefix caching) on the C++ CPU
backend and the torch reference, and must equal `generate(do_sample=False)` token for token.

- gemma3: 4 layers, sliding window 16 on three (prompts run to 71 tokens), its own RoPE base on
  sliding layers and linear-scaled RoPE on the global one, query_pre_attn_scalar != head_dim,
  final logit soft-capping, (1 + weight) norms, output norms, scaled embeddings, GELU-tanh MLP.
- phi3: Phi-3-mini's shape (full RoPE) with head_dim 32, so the CPU backend packs its KV and runs
  all layers in one C++ call.
- phi3_partial_longrope: Phi-4-mini's kind: partial RoPE (24 of 32 dims), longrope (static below
  original_max_position_embeddings) and a sliding window on every layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import engine_config
from tests.engine.oracle_scenarios import (
    SCENARIOS,
    VOCAB_SIZE,
    mixed_prompts,
    prompt_kind,
    run_scenario,
    shared_prefix_prompts,
    transformers_reference,
)
from tests.engine.scoring import mean_logprob
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.architectures import UnsupportedModelError
from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
from tokenloom.engine.models.loader import ModelLoadError
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

GEMMA3_WINDOW = 16
NUM_LONG_PROMPTS = 12  # of the 24 oracle prompts at least this many run past twice Gemma 3's window
INT8_DRIFT_BOUND = (
    0.02  # nats/token of mean log-likelihood, as for stories260K in tests/engine/models/test_quantization.py
)
COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, initializer_range=0.1)
PHI3_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=None,
)

FAMILY_CONFIGS = {
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON,
        pad_token_id=0,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=GEMMA3_WINDOW,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        architectures=["Gemma3ForCausalLM"],
    ),
    "phi3": lambda: transformers.Phi3Config(
        **COMMON, **PHI3_SHAPE, max_position_embeddings=256, architectures=["Phi3ForCausalLM"]
    ),
    "phi3_partial_longrope": lambda: transformers.Phi3Config(
        **COMMON,
        **PHI3_SHAPE,
        max_position_embeddings=512,
        original_max_position_embeddings=256,
        sliding_window=32,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(12)],
            "long_factor": [2.0 + 0.1 * i for i in range(12)],
        },
        architectures=["Phi3ForCausalLM"],
    ),
}


def build_family_checkpoint(path: Path, config, seed: int) -> Path:
    """A seeded random model of `config` with distinct norm weights (Gemma's start at zero, the others
    at one: a norm applied with another's weight, or without Gemma's +1, would then show) and the
    demo tokenizer."""
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: build_family_checkpoint(root / name, make(), seed=i)
        for i, (name, make) in enumerate(FAMILY_CONFIGS.items())
    }


@pytest.fixture(scope="module")
def references(checkpoints):
    cache = {}

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            prompts = (shared_prefix_prompts if kind == "prefix" else mixed_prompts)(seed=len(family))
            cache[family, kind] = (prompts, transformers_reference(checkpoints[family], prompts))
        return cache[family, kind]

    return get


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_transformers_generate(family, scenario, backend, checkpoints, references):
    prompts, expected = references(family, prompt_kind(scenario))
    run_scenario(checkpoints[family], scenario, backend, prompts, expected)


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_log_likelihood_equals_transformers(checkpoints, family):
    """Logits, not only their argmax: Gemma 3's final soft-capping is monotonic, so only the
    probabilities show it."""
    text = [1] + [(7 * i) % (VOCAB_SIZE - 3) + 3 for i in range(90)]
    engine = Engine(engine_config(checkpoints[family], model=dict(max_model_len=128, attention_backend="torch")))
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([text])).logits[0, :-1]
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(text[1:])[:, None]).mean().item()
    assert mean_logprob(engine, text) == pytest.approx(expected, abs=1e-5)


def test_gemma3_sliding_window_decides_tokens_past_it(checkpoints, references):
    """The oracle prompts outgrow Gemma 3's window, and the window shows: the same engine with its
    sliding layers attending globally no longer matches transformers."""
    prompts, expected = references("gemma3", "mixed")
    assert sum(len(prompt) > 2 * GEMMA3_WINDOW for prompt, _ in prompts) >= NUM_LONG_PROMPTS
    engine = Engine(engine_config(checkpoints["gemma3"], model=dict(max_model_len=128, attention_backend="torch")))
    windows = [layer.self_attn.sliding_window for layer in engine.runner.model.layers]
    assert windows == [GEMMA3_WINDOW, GEMMA3_WINDOW, None, GEMMA3_WINDOW]
    for layer in engine.runner.model.layers:
        layer.self_attn.sliding_window = None
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _, max_tokens in prompts]
    actual = [o.outputs[0].token_ids for o in engine.generate([p for p, _ in prompts], params)]
    assert sum(a != e for a, e in zip(actual, expected)) >= 1


@pytest.mark.parametrize(
    "family, stack_used, fallback_reason",
    [
        ("gemma3", False, "gelu_pytorch_tanh MLP, attention/MLP output norms, two RoPE tables"),
        ("phi3", True, None),
        ("phi3_partial_longrope", False, "partial RoPE"),
    ],
)
def test_startup_report_names_the_family_and_whether_the_cpu_decoder_stack_runs_it(
    checkpoints, family, stack_used, fallback_reason
):
    engine = Engine(engine_config(checkpoints[family], model=dict(max_model_len=128, attention_backend="cpu")))
    if stack_used and not engine.backend.uses_packed_layout(engine.runner.kv_caches[0][0]):
        pytest.skip(
            f"this CPU serves the plain KV layout ({engine.backend.describe(engine.runner.kv_caches[0][0])}); "
            "the C++ decoder stack runs on the packed one only"
        )
    report = engine.startup_report
    architecture = json.loads((checkpoints[family] / "config.json").read_text())["architectures"][0]
    assert f"family {architecture.removesuffix('ForCausalLM')}: " in report
    assert ("decoder layers in one C++ call" in report) == stack_used
    assert (engine.runner.model.decoder_stack_for(engine.backend, engine.runner.kv_caches) is not None) == stack_used
    if fallback_reason:
        assert f"CPU decoder stack (all layers in one C++ call) not used: it has no {fallback_reason}" in report
    expected_notes = {
        "gemma3": [
            "RMSNorm x (1 + weight)",
            "final logits soft-capped at 30",
            "own RoPE base on sliding layers",
            f"sliding window {GEMMA3_WINDOW} on 3 of 4 layers",
            "per-head q/k norms",
        ],
        "phi3": ["fused qkv/gate_up in the checkpoint"],
        "phi3_partial_longrope": [
            "partial RoPE (24 of 32 dims per head)",
            "longrope, static below original_max_position_embeddings = 256",
        ],
    }[family]
    assert all(note in report for note in expected_notes), report


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_int8_quantizes_every_dense_linear_and_keeps_the_likelihood(checkpoints, family):
    # The torch backend: tests/engine/scoring.py builds its step by hand, without the C++ kernels' tables.
    config = engine_config(checkpoints[family], model=dict(max_model_len=128, attention_backend="torch"))
    full = Engine(config)
    quantized = Engine(config.replace("quantization", enabled=True, method="int8"))
    report = quantized.loaded.quantization
    num_layers = quantized.loaded.shape.num_layers
    assert report.quantized_layers + len(report.kept) == 4 * num_layers and report.quantized_layers > 0
    assert f"after {report.method} quantization" in quantized.startup_report
    text = [1] + list(range(3, 90))
    assert abs(mean_logprob(quantized, text) - mean_logprob(full, text)) < INT8_DRIFT_BOUND
    outputs = quantized.generate(
        [[1, 5, 9, 33], [1] + list(range(40, 80))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]


def test_longrope_positions_stop_where_longrope_stops_being_static(checkpoints):
    with pytest.raises(ModelLoadError, match=r"max_position_embeddings \(256\)"):
        Engine(engine_config(checkpoints["phi3_partial_longrope"], model=dict(max_model_len=300)))


def _with_config_changes(checkpoint: Path, target: Path, **changes) -> Path:
    """`checkpoint`'s files linked into `target`, with config.json edited."""
    target.mkdir()
    for item in checkpoint.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item)
    config = json.loads((checkpoint / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_gemma3_with_sliding_layers_only_equals_transformers(tmp_path, backend):
    """transformers saves a 4-layer Gemma 3 with its default pattern (one global layer in six) as
    sliding layers only: no global RoPE table exists, and none is needed."""
    config = FAMILY_CONFIGS["gemma3"]()
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    checkpoint = build_family_checkpoint(tmp_path / "gemma3_all_sliding", config, seed=7)
    assert "full_attention" not in json.loads((checkpoint / "config.json").read_text())["layer_types"]
    prompts = mixed_prompts(seed=7)
    run_scenario(checkpoint, "chunked_prefill", backend, prompts, transformers_reference(checkpoint, prompts))


def test_bidirectional_gemma3_is_refused(tmp_path, checkpoints):
    checkpoint = _with_config_changes(
        checkpoints["gemma3"], tmp_path / "bidirectional", use_bidirectional_attention=True
    )
    with pytest.raises(UnsupportedModelError, match="causal attention only"):
        Engine(engine_config(checkpoint))


def test_unsupported_architecture_lists_gemma3_and_phi3(tmp_path, checkpoints):
    checkpoint = _with_config_changes(checkpoints["phi3"], tmp_path / "gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModelError) as err:
        Engine(engine_config(checkpoint))
    assert "tokenloom runs" in str(err.value)
    assert "Gemma3ForCausalLM" in str(err.value) and "Phi3ForCausalLM" in str(err.value)
