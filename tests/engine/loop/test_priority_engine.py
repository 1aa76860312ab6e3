"""Priority scheduling end to end on stories260K: an interactive request that arrives while a batch
fills `max_num_seqs` and a small KV pool runs at the next step, and the batch requests it
preempted (recomputed, or swapped to host memory and back) still produce the greedy tokens of
transformers' `generate`, token for token.
"""

from __future__ import annotations

import random

import pytest

from tests.conftest import engine_config
from tests.engine.oracle_scenarios import transformers_reference
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

BATCH_PRIORITY, INTERACTIVE_PRIORITY = 1, 0
NUM_BATCH, NUM_INTERACTIVE = 4, 2


def prompts(seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): the batch requests first, then the interactive ones."""
    rng = random.Random(seed)
    batch = [([1] + [rng.randrange(3, 512) for _ in range(rng.randint(12, 20))], 40) for _ in range(NUM_BATCH)]
    interactive = [
        ([1] + [rng.randrange(3, 512) for _ in range(rng.randint(6, 10))], 12) for _ in range(NUM_INTERACTIVE)
    ]
    return batch + interactive


@pytest.mark.parametrize("swap_space_gb", [0.0, 1.0], ids=["recompute", "swap"])
def test_interactive_request_runs_next_step_and_preempted_batch_output_is_unchanged(swap_space_gb, stories260k):
    expected = transformers_reference(stories260k, prompts(seed=36))
    # 40 blocks of 4 tokens: four batch requests of up to 61 tokens do not all fit.
    config = engine_config(
        stories260k,
        model=dict(max_model_len=128),
        kv_cache=dict(block_size=4, num_blocks=40, enable_prefix_caching=False, swap_space_gb=swap_space_gb),
        scheduler=dict(max_num_seqs=NUM_BATCH, max_num_batched_tokens=64),
    )
    engine = Engine(config)
    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    requests = prompts(seed=36)
    finals = {}

    def step():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output

    for i, (prompt, max_tokens) in enumerate(requests[:NUM_BATCH]):
        engine.add_request(
            f"batch-{i}", prompt, params=SamplingParams(temperature=0.0, max_tokens=max_tokens), priority=BATCH_PRIORITY
        )
    for _ in range(6):  # the batch is prefilled and decoding, all seats taken
        step()
    assert len(engine.scheduler.running) == NUM_BATCH and not finals

    for i, (prompt, max_tokens) in enumerate(requests[NUM_BATCH:]):
        engine.add_request(
            f"interactive-{i}",
            prompt,
            params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
            priority=INTERACTIVE_PRIORITY,
        )
    step()
    arrival_plan = plans[-1]
    scheduled = {chunk.seq.request_id for chunk in arrival_plan.chunks}
    assert {f"interactive-{i}" for i in range(NUM_INTERACTIVE)} <= scheduled
    assert len(arrival_plan.preempted) >= NUM_INTERACTIVE
    assert all(seq.priority == BATCH_PRIORITY for seq in arrival_plan.preempted)

    while engine.has_unfinished_requests:
        step()
    ids = [f"batch-{i}" for i in range(NUM_BATCH)] + [f"interactive-{i}" for i in range(NUM_INTERACTIVE)]
    actual = [finals[request_id].outputs[0].token_ids for request_id in ids]
    mismatches = [request_id for request_id, a, e in zip(ids, actual, expected) if a != e]
    assert not mismatches, f"greedy tokens differ from transformers for {mismatches}"
    assert engine.scheduler.num_priority_preemptions >= NUM_INTERACTIVE
    if swap_space_gb:
        assert engine.counters.num_swap_outs > 0
        assert engine.scheduler.swap.num_free_blocks == engine.scheduler.swap.num_blocks
    else:
        assert engine.counters.num_preemptions > 0 and engine.counters.num_swap_outs == 0
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_plan.num_blocks  # no leaked blocks
