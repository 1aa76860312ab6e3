"""The greedy-oracle scenarios shared by every family's test: prompts, pressures and the check.

24+ prompts of mixed lengths submitted together under four pressures: a small token budget
(chunked prefill, mixed prefill+decode steps), a tiny KV pool (preemption with recompute; and with
the KV swapped to host memory and back) and shared prompt prefixes (prefix-cache hits). The
engine's greedy tokens must equal transformers' `generate(do_sample=False)`, token for token.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

NUM_PROMPTS = 24
VOCAB_SIZE = 384  # the demo tokenizer's

Prompts = list[tuple[list[int], int]]  # (prompt token ids, max_tokens)


def mixed_prompts(seed: int, max_extra_tokens: int = 70) -> Prompts:
    rng = random.Random(seed)
    return [
        ([1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, max_extra_tokens))], rng.randint(4, 24))
        for _ in range(NUM_PROMPTS)
    ]


def shared_prefix_prompts(seed: int) -> Prompts:
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(40)] for _ in range(3)]
    return [
        (prefixes[i % 3] + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 20))], rng.randint(4, 16))
        for i in range(NUM_PROMPTS)
    ]


def transformers_reference(checkpoint: Path, prompts: Prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outputs = []
    for prompt, max_tokens in prompts:
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, pad_token_id=2
            )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


SCENARIOS = {
    # 24-token budget: prompts of up to 71 tokens take several steps and share steps with decodes.
    "chunked_prefill": dict(scheduler=dict(max_num_batched_tokens=24, max_num_seqs=16)),
    # 40 blocks of 4 tokens for 24 sequences of up to 95 tokens: the pool runs dry, sequences are preempted.
    # Preempted sequences are recomputed (no swap space) ...
    "preemption": dict(
        kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=0.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24),
    ),
    # ... or their KV goes to host memory and comes back (swap space for 40 blocks).
    "swap": dict(
        kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=1.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24),
    ),
    "prefix_cache": dict(scheduler=dict(max_num_batched_tokens=128, max_num_seqs=8)),
}


def prompt_kind(scenario: str) -> str:
    return "prefix" if scenario == "prefix_cache" else "mixed"


def run_scenario(checkpoint: Path, scenario: str, backend: str, prompts: Prompts, expected: list[list[int]]) -> Engine:
    """Run `prompts` on an engine under `scenario`; assert greedy equality and that the pressure happened."""
    config = engine_config(checkpoint, model=dict(max_model_len=128, attention_backend=backend), **SCENARIOS[scenario])
    engine = Engine(config)
    assert engine.backend.name == backend
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _, max_tokens in prompts]
    outputs = engine.generate([prompt for prompt, _ in prompts], params)
    actual = [output.outputs[0].token_ids for output in outputs]
    mismatches = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    assert not mismatches, (
        f"{len(mismatches)} prompts differ, first #{mismatches[0]}: {actual[mismatches[0]]} vs {expected[mismatches[0]]}"
    )
    counters = engine.counters
    if scenario == "chunked_prefill":
        assert counters.num_mixed_steps > 0 and counters.max_prefill_chunks_in_step > 1
    if scenario == "preemption":
        assert counters.num_preemptions > 0 and counters.num_swap_outs == 0
    if scenario == "swap":
        assert counters.num_swap_outs > 0
        assert engine.scheduler.swap.num_free_blocks == engine.scheduler.swap.num_blocks
    if scenario == "prefix_cache":
        assert counters.prefix_cache_hits >= 20 * 32  # 21 of 24 prompts reuse 2 full blocks of the prefix
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_plan.num_blocks  # no leaked blocks
    return engine
