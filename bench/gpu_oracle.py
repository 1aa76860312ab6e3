"""Greedy equality with transformers on the check's device, in float32, for the four families
under the greedy oracle's pressures: chunked prefill, preemption by recompute and by swap, and
prefix-cache hits. Random small checkpoints (seeded), prompts as token ids.

The newer families add one bfloat16 case: a Qwen3-MoE whose experts take torch's grouped GEMM
(on compute capability 9.x/10.x), so its decode steps run as CUDA graphs; its greedy tokens with
graphs must equal its own tokens without them, at batch sizes the graphs capture (bfloat16 is not
compared with transformers: rounding may part them, which says nothing of the graphs).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tokenloom.engine.config import EngineConfig
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

FAMILIES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=24),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=32),
}
# The newer families on the device: routed experts (in float32 the per-expert loop, so graphs off),
# Gemma 3's sliding/global layers with two RoPE tables, Phi-3's fused projections with partial RoPE.
NEWER_FAMILIES = {
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
    "gemma3": dict(
        architecture="Gemma3ForCausalLM",
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    ),
    "phi3_partial_rope": dict(architecture="Phi3ForCausalLM", partial_rotary_factor=0.75, sliding_window=32),
}
NEWER_SCENARIOS = ("chunked_prefill", "swap")
SCENARIOS = {
    "chunked_prefill": dict(scheduler=dict(max_num_batched_tokens=24, max_num_seqs=16)),
    "preemption": dict(
        kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=0.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24),
    ),
    "swap": dict(
        kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=1.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24),
    ),
    "prefix_cache": dict(scheduler=dict(max_num_batched_tokens=128, max_num_seqs=8)),
}
NUM_PROMPTS = 24
# The bfloat16 graphs-vs-eager case: a batch that is a graph bucket and stays whole (ignore_eos, one
# max_tokens), so every decode step replays the bucket's graph with no padding rows.
GRAPH_CASE_FAMILY = "qwen3_moe"
GRAPH_CASE_BATCH = 8
GRAPH_CASE_TOKENS = 16


def prompts_for(
    scenario: str, vocab_size: int, seed: int, num_prompts: int = NUM_PROMPTS
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if scenario != "prefix_cache":
        return [
            ([1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 70))], rng.randint(4, 24))
            for _ in range(num_prompts)
        ]
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(40)] for _ in range(3)]
    return [
        (prefixes[i % 3] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 20))], rng.randint(4, 16))
        for i in range(num_prompts)
    ]


def reference(checkpoint: Path, prompts, device: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    outputs = []
    with torch.no_grad():
        for prompt, max_tokens in prompts:
            generated = model.generate(
                torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=max_tokens, pad_token_id=2
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def engine_config(
    checkpoint: Path, device: str, backend: str, sections: dict, dtype: str = "float32", enforce_eager: bool = False
) -> EngineConfig:
    """The engine a case runs: the scenario's [kv_cache]/[scheduler] changes over the defaults."""
    config = load_config(None, env={}).replace(
        "model",
        name=str(checkpoint),
        dtype=dtype,
        device=device,
        attention_backend=backend,
        max_model_len=128,
        enforce_eager=enforce_eager,
    )
    for section, changes in sections.items():
        config = config.replace(section, **changes)
    return config


def selected_cases(
    smoke: bool = False,
    newer: bool = False,
    only_families: list[str] | None = None,
    only_scenarios: list[str] | None = None,
) -> tuple[dict[str, dict], dict[str, dict]]:
    """(families, scenarios) a run covers: see `run`."""
    if newer:
        families = dict(list(NEWER_FAMILIES.items())[:1]) if smoke else NEWER_FAMILIES
        scenarios = {name: SCENARIOS[name] for name in NEWER_SCENARIOS[-1 if smoke else 0 :]}
    else:
        families = dict(list(FAMILIES.items())[:1]) if smoke else FAMILIES
        scenarios = {"swap": SCENARIOS["swap"]} if smoke else SCENARIOS
    if only_families is not None:
        families = {name: (NEWER_FAMILIES | FAMILIES)[name] for name in only_families}
    if only_scenarios is not None:
        scenarios = {name: SCENARIOS[name] for name in only_scenarios}
    return families, scenarios


def build_checkpoint(root: Path, family: str, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    spec = (NEWER_FAMILIES | FAMILIES)[family]
    return build_random_checkpoint(
        root / f"{family}-{str(dtype).removeprefix('torch.')}",
        seed=seed,
        max_position_embeddings=256,
        initializer_range=0.1,
        dtype=dtype,
        **spec,
    )


def graphs_note(engine: Engine) -> dict:
    """Whether the engine's decode steps run as graphs, and if not, why (a failed capture included)."""
    return {"graphs": engine.runner.graphs is not None, "graphs_plan": engine.graph_plan.describe()}


def run(
    root: Path,
    device: str,
    backend: str,
    smoke: bool = False,
    newer: bool = False,
    only_families: list[str] | None = None,
    only_scenarios: list[str] | None = None,
    progress: dict | None = None,
) -> dict:
    """`newer`: NEWER_FAMILIES under NEWER_SCENARIOS instead of the four original families, then
    the bfloat16 graphs-vs-eager case; `only_*`: a subset of those (the smoke section's one case);
    `progress` gets `cases` after each case (a RecordedResult saves it, so a killed run keeps them)."""
    families, scenarios = selected_cases(smoke, newer, only_families, only_scenarios)
    cases = []
    for index, family in enumerate(families):
        checkpoint = build_checkpoint(root, family, seed=index)
        for scenario, sections in scenarios.items():
            prompts = prompts_for(scenario, 384, seed=len(family), num_prompts=8 if smoke else NUM_PROMPTS)
            expected = reference(checkpoint, prompts, device)
            engine = Engine(engine_config(checkpoint, device, backend, sections))
            outputs = engine.generate(
                [p for p, _ in prompts], [SamplingParams(temperature=0.0, max_tokens=m) for _, m in prompts]
            )
            actual = [o.outputs[0].token_ids for o in outputs]
            differ = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
            c = engine.counters
            case = {
                "family": family,
                "scenario": scenario,
                "equal": not differ,
                "num_differ": len(differ),
                "preemptions": c.num_preemptions,
                "swap_outs": c.num_swap_outs,
                "prefix_cache_hits": c.prefix_cache_hits,
                "mixed_steps": c.num_mixed_steps,
                **graphs_note(engine),
            }
            if differ:
                case["first_difference"] = {
                    "prompt": differ[0],
                    "tokenloom": actual[differ[0]],
                    "transformers": expected[differ[0]],
                }
            _record_case(cases, case, progress)
            del engine
    if newer and only_families is None:
        _record_case(cases, graphs_vs_eager(root, device, backend), progress)
    return {"cases": cases, "all_equal": all(c["equal"] for c in cases)}


def _record_case(cases: list[dict], case: dict, progress: dict | None) -> None:
    cases.append(case)
    if progress is not None:
        progress["cases"] = cases
    outcome = "equal" if case["equal"] else f"{case.get('num_differ', '?')} prompts differ"
    print(f"oracle {case['family']} {case['scenario']}: {outcome}", flush=True)


def graphs_vs_eager(root: Path, device: str, backend: str) -> dict:
    """The bfloat16 Qwen3-MoE with CUDA graphs (where its experts allow them) against itself eager."""
    checkpoint = build_checkpoint(root, GRAPH_CASE_FAMILY, seed=0, dtype=torch.bfloat16)
    rng = random.Random(GRAPH_CASE_BATCH)
    prompts = [[1] + [rng.randrange(3, 384) for _ in range(rng.randint(4, 40))] for _ in range(GRAPH_CASE_BATCH)]
    params = SamplingParams(temperature=0.0, max_tokens=GRAPH_CASE_TOKENS, ignore_eos=True)
    sections = {"scheduler": dict(max_num_seqs=GRAPH_CASE_BATCH, max_num_batched_tokens=512)}
    tokens, notes = {}, {}
    for name, eager in (("graphs", False), ("eager", True)):
        engine = Engine(engine_config(checkpoint, device, backend, sections, dtype="bfloat16", enforce_eager=eager))
        tokens[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        notes[name] = graphs_note(engine)
        del engine
    differ = [i for i, (a, b) in enumerate(zip(tokens["graphs"], tokens["eager"])) if a != b]
    return {
        "family": GRAPH_CASE_FAMILY,
        "scenario": f"bfloat16 graphs vs eager, batch {GRAPH_CASE_BATCH}",
        "equal": not differ,
        "num_differ": len(differ),
        **notes["graphs"],
        "eager_graphs_plan": notes["eager"]["graphs_plan"],
    }
