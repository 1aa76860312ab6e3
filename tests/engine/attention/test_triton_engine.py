"""The whole engine's greedy output with attention_backend = "triton" equals the torch backend's.

Eight prompts (1 to 40 tokens) on tiny random checkpoints, under a small token budget
(chunked prefill, steps mixing prefill chunks and decodes), a pool too small for all sequences
(preemption, block reuse, fragmented block tables) and shared prefixes (prefix-cache hits, so
chunks start over cached blocks). Mistral's sliding window (24) is shorter than the longest
contexts. On CPU the kernels run in triton's interpreter, hence the small sizes.
"""

from __future__ import annotations

import random

import pytest

from tests.conftest import engine_config
from tests.engine.triton_support import require_kernel_runtime
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

require_kernel_runtime()


def _waves(vocab_size: int = 384) -> list[list[list[int]]]:
    """Batches run one after another; the last two share a 12-token prefix (3 blocks of 4)."""
    rng = random.Random(5)
    prefix = [1] + [rng.randrange(3, vocab_size) for _ in range(11)]
    fresh = [[1] + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (0, 4, 16, 29, 39)]
    shared = [prefix + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (2, 9, 5)]
    return [shared[:1] + fresh, shared[1:2], shared[2:]]


def _run(checkpoint, backend: str) -> tuple[list[list[int]], Engine]:
    config = engine_config(
        checkpoint,
        model=dict(attention_backend=backend, max_model_len=64),
        kv_cache=dict(block_size=4, num_blocks=20),  # 80 slots for 6 sequences of up to 52 tokens
        scheduler=dict(max_num_batched_tokens=16, max_num_seqs=6),
    )
    engine = Engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The last wave starts on the prefix blocks the one before it left in the (idle) pool.
    outputs = [output for wave in _waves() for output in engine.generate(wave, params)]
    return [output.outputs[0].token_ids for output in outputs], engine


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_tokens_with_triton_backend_equal_torch_backend(family, family_checkpoints):
    expected, _ = _run(family_checkpoints[family], "torch")
    actual, engine = _run(family_checkpoints[family], "triton")
    assert engine.backend.name == "triton" and "attention backend triton" in engine.startup_report
    mismatches = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    assert not mismatches, f"prompt #{mismatches[0]}: triton {actual[mismatches[0]]} vs torch {expected[mismatches[0]]}"
    counters = engine.counters
    # The run went through every path it claims to: mixed steps, preemption, prefix-cache hits
    # (the last prompt starts on 3 cached blocks).
    assert counters.num_mixed_steps > 0 and counters.num_preemptions > 0 and counters.prefix_cache_hits >= 12
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_plan.num_blocks
