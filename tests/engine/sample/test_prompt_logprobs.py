"""Prompt logprobs (vLLM's `prompt_logprobs: k`, OpenAI's `echo`) against transformers.

For every supported family, each prompt token after the first must get the log-softmax of
transformers' logits at the position before it, and its top-k alternatives, under the pressures
that move prefill around: a small token budget (a prompt scored across several chunks, sharing steps
with decodes of other requests), a tiny KV pool (preemption with recompute: positions scored before
the preemption are neither lost nor scored twice), and prefix caching (a prompt whose prefix is
cached still gets every position). Scoring requests (max_tokens 0) run in the same batches as
generating ones, whose tokens must stay those of `generate()`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import FAMILIES, ORACLE_CONFIG, engine_config
from tests.engine.oracle.test_family_oracle import FAMILY_CONFIGS, build_family_checkpoint
from tests.engine.oracle.test_moe_oracle import MOE_FAMILIES
from tests.engine.oracle_scenarios import VOCAB_SIZE, transformers_reference
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

TOP_K = 3
LOGPROB_TOLERANCE = 1e-4  # float32 on both sides; different kernels sum in different orders

SCENARIOS = {
    "chunked_prefill": dict(scheduler=dict(max_num_batched_tokens=24, max_num_seqs=16)),
    # 16 blocks of 4 tokens for 12 requests of up to 49 tokens: sequences are preempted and recomputed.
    "preemption": dict(
        kv_cache=dict(block_size=4, num_blocks=16, enable_prefix_caching=False, swap_space_gb=0.0),
        scheduler=dict(max_num_batched_tokens=64, max_num_seqs=24),
        model=dict(max_model_len=64),
    ),
    "prefix_cache": dict(kv_cache=dict(block_size=4), scheduler=dict(max_num_batched_tokens=128, max_num_seqs=8)),
}


@pytest.fixture(scope="module")
def all_family_checkpoints(tmp_path_factory, family_checkpoints) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompt_logprobs")
    checkpoints = dict(family_checkpoints)
    for i, (name, make) in enumerate(FAMILY_CONFIGS.items()):
        if name != "phi3_partial_longrope":  # the same family as phi3
            checkpoints[name] = build_family_checkpoint(root / name, make(), seed=30 + i)
    for i, (name, spec) in enumerate(MOE_FAMILIES.items()):
        checkpoints[name] = build_random_checkpoint(root / name, seed=40 + i, **ORACLE_CONFIG, **spec)
    return checkpoints


FAMILY_NAMES = [*FAMILIES, "gemma3", "phi3", *MOE_FAMILIES]


def _prompts(seed: int, shared_prefix: bool) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, VOCAB_SIZE) for _ in range(30)]
    return [
        (prefix if shared_prefix else [1]) + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(2, 40))]
        for _ in range(8)
    ]


def _expected(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each prompt token after the first [P-1], top-k ids at each position [P-1, k])."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], logprobs


def _check(output, prompt: list[int], model) -> None:
    chosen, logprobs = _expected(model, prompt)
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    actual = torch.tensor([e.logprob for e in entries[1:]])
    torch.testing.assert_close(actual, chosen, atol=LOGPROB_TOLERANCE, rtol=0)
    for position, entry in enumerate(entries[1:]):
        assert len(entry.top) == TOP_K
        top_logprobs = torch.tensor([lp for _, lp in entry.top])
        # Ids can swap between near-ties; each alternative's logprob must be transformers' for that id.
        theirs = logprobs[position, [token for token, _ in entry.top]]
        torch.testing.assert_close(top_logprobs, theirs, atol=LOGPROB_TOLERANCE, rtol=0)
        torch.testing.assert_close(top_logprobs, logprobs[position].topk(TOP_K).values, atol=LOGPROB_TOLERANCE, rtol=0)


# Every family under the mixed-batch pressure; the pressures that move positions around (a
# preemption, a cached prefix) on two families with different attention shapes.
CASES = [(family, "chunked_prefill") for family in FAMILY_NAMES] + [
    (family, scenario) for family in ("llama", "qwen3") for scenario in ("preemption", "prefix_cache")
]


@pytest.mark.parametrize("family, scenario", CASES)
def test_prompt_logprobs_equal_transformers_log_softmax(family, scenario, all_family_checkpoints):
    checkpoint = all_family_checkpoints[family]
    prompts = _prompts(seed=len(family), shared_prefix=scenario == "prefix_cache")
    generating = [(p[: len(p) // 2 + 1], 8) for p in prompts[::2]]
    sections = SCENARIOS[scenario]
    model_section = {"max_model_len": 128, "attention_backend": "torch", **sections.get("model", {})}
    engine = Engine(engine_config(checkpoint, **{**sections, "model": model_section}))
    if scenario == "prefix_cache":  # the shared prefix is cached before the scoring requests come
        engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1))
    scoring = [SamplingParams(max_tokens=0, prompt_logprobs=TOP_K)] * len(prompts)
    # Half the scoring requests also generate: prompt logprobs plus sampled tokens from one request.
    scoring = [
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP_K) if i % 2 else s
        for i, s in enumerate(scoring)
    ]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for _, n in generating]
    outputs = engine.generate(prompts + [p for p, _ in generating], scoring + greedy)

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, output, params in zip(prompts, outputs, scoring):
        _check(output, prompt, model)
        assert len(output.outputs[0].token_ids) == params.max_tokens
        assert output.outputs[0].finish_reason == "length"
    scored_and_generated = [(p, 4) for p, s in zip(prompts, scoring) if s.max_tokens]
    expected_tokens = transformers_reference(checkpoint, generating + scored_and_generated)
    actual_tokens = [o.outputs[0].token_ids for o in outputs[len(prompts) :]] + [
        o.outputs[0].token_ids for o, s in zip(outputs, scoring) if s.max_tokens
    ]
    assert actual_tokens == expected_tokens
    counters = engine.counters
    if scenario == "chunked_prefill":
        assert counters.num_mixed_steps > 0
    if scenario == "preemption":
        assert counters.num_preemptions > 0
    if scenario == "prefix_cache":
        assert counters.prefix_cache_hits > 0  # the generating requests reuse the cached prefix
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_plan.num_blocks


def test_a_cached_prefix_is_recomputed_for_scoring_and_reused_once_scored(llama_checkpoint):
    """Positions read from the prefix cache have no logits: a scoring request computes its whole prompt,
    then a later request reuses the blocks it cached."""
    engine = Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128), kv_cache=dict(block_size=4)))
    prompt = _prompts(seed=5, shared_prefix=True)[0]
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    hits_before = engine.counters.prefix_cache_hits
    [scored] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert engine.counters.prefix_cache_hits == hits_before
    assert all(e is not None and e.top == [] for e in scored.prompt_logprobs[1:])
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.counters.prefix_cache_hits > hits_before
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32).eval()
    chosen, _ = _expected(model, prompt)
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in scored.prompt_logprobs[1:]]), chosen, atol=LOGPROB_TOLERANCE, rtol=0
    )


def test_score_only_requests_generate_nothing_and_free_their_blocks(llama_checkpoint):
    engine = Engine(engine_config(llama_checkpoint, model=dict(max_model_len=64)))
    prompt = [1] + list(range(3, 66))  # exactly max_model_len: room only for scoring
    [output] = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert output.finished and output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    assert output.metrics.ttft_s is None and len(output.prompt_logprobs) == 64
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_plan.num_blocks
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("too-long", prompt, params=SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prompt_logprobs", 21, "prompt_logprobs must be <= 20"),
        ("prompt_logprobs", -1, "prompt_logprobs must be >= 0"),
        ("max_tokens", -1, "max_tokens must be >= 0"),
    ],
)
def test_out_of_range_scoring_fields_are_refused(field, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value}).validate()
