"""Greedy equality with transformers on the check's device, in float32, for the four families
under the greedy oracle's pressures: chunked prefill, preemption by recompute and by swap, and
prefix-cache hits. Random small checkpoints (seeded), prompts as token ids."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.loop.engine import Engine
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
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", num_hidden_layers=3, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "mixtral": dict(architecture="MixtralForCausalLM", num_hidden_layers=2, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=48),
    "gemma3": dict(architecture="Gemma3ForCausalLM", num_hidden_layers=4, head_dim=16, sliding_window=16,
                   query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    "phi3_partial_rope": dict(architecture="Phi3ForCausalLM", partial_rotary_factor=0.75, sliding_window=32),
}
NEWER_SCENARIOS = ("chunked_prefill", "swap")
SCENARIOS = {
    "chunked_prefill": dict(scheduler=dict(max_num_batched_tokens=24, max_num_seqs=16)),
    "preemption": dict(kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=0.0),
                       scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24)),
    "swap": dict(kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=1.0),
                 scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24)),
    "prefix_cache": dict(scheduler=dict(max_num_batched_tokens=128, max_num_seqs=8)),
}
NUM_PROMPTS = 24


def prompts_for(scenario: str, vocab_size: int, seed: int, num_prompts: int = NUM_PROMPTS) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if scenario != "prefix_cache":
        return [([1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 70))], rng.randint(4, 24))
                for _ in range(num_prompts)]
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(40)] for _ in range(3)]
    return [(prefixes[i % 3] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 20))], rng.randint(4, 16))
            for i in range(num_prompts)]


def reference(checkpoint: Path, prompts, device: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    outputs = []
    with torch.no_grad():
        for prompt, max_tokens in prompts:
            generated = model.generate(torch.tensor([prompt], device=device), do_sample=False,
                                       max_new_tokens=max_tokens, pad_token_id=2)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def run(root: Path, device: str, backend: str, smoke: bool = False, newer: bool = False,
        only_families: list[str] | None = None, only_scenarios: list[str] | None = None,
        progress: dict | None = None) -> dict:
    """`newer`: NEWER_FAMILIES under NEWER_SCENARIOS instead of the four original families;
    `only_*`: a subset of those (the smoke section's one case); `progress` gets `cases` after each
    case (a RecordedResult saves it, so a killed run keeps them)."""
    if newer:
        families = dict(list(NEWER_FAMILIES.items())[:1]) if smoke else NEWER_FAMILIES
        scenarios = {name: SCENARIOS[name] for name in NEWER_SCENARIOS[-1 if smoke else 0:]}
    else:
        families = dict(list(FAMILIES.items())[:1]) if smoke else FAMILIES
        scenarios = {"swap": SCENARIOS["swap"]} if smoke else SCENARIOS
    if only_families is not None:
        families = {name: (NEWER_FAMILIES | FAMILIES)[name] for name in only_families}
    if only_scenarios is not None:
        scenarios = {name: SCENARIOS[name] for name in only_scenarios}
    cases = []
    for index, (family, spec) in enumerate(families.items()):
        checkpoint = build_random_checkpoint(root / family, seed=index, max_position_embeddings=256,
                                             initializer_range=0.1, **spec)
        for scenario, sections in scenarios.items():
            prompts = prompts_for(scenario, 384, seed=len(family), num_prompts=8 if smoke else NUM_PROMPTS)
            expected = reference(checkpoint, prompts, device)
            config = load_config(None, env={}).replace(
                "model", name=str(checkpoint), dtype="float32", device=device, attention_backend=backend,
                max_model_len=128)
            for section, changes in sections.items():
                config = config.replace(section, **changes)
            engine = Engine(config)
            outputs = engine.generate([p for p, _ in prompts],
                                      [SamplingParams(temperature=0.0, max_tokens=m) for _, m in prompts])
            actual = [o.outputs[0].token_ids for o in outputs]
            differ = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
            c = engine.counters
            case = {"family": family, "scenario": scenario, "equal": not differ, "num_differ": len(differ),
                    "preemptions": c.num_preemptions, "swap_outs": c.num_swap_outs,
                    "prefix_cache_hits": c.prefix_cache_hits, "mixed_steps": c.num_mixed_steps,
                    "graphs": engine.runner.graphs is not None}
            if differ:
                case["first_difference"] = {"prompt": differ[0], "tokenloom": actual[differ[0]],
                                            "transformers": expected[differ[0]]}
            cases.append(case)
            if progress is not None:
                progress["cases"] = cases
            print(f"oracle {family} {scenario}: {'equal' if not differ else f'{len(differ)} prompts differ'}", flush=True)
            del engine
    return {"cases": cases, "all_equal": all(c["equal"] for c in cases)}
