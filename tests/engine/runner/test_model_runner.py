"""What the model runner prepares for a step, per backend."""

from __future__ import annotations

import pytest

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams


@pytest.mark.parametrize("backend, finds_start", [("torch", True), ("triton", False)])
def test_the_contiguous_start_of_a_context_is_found_only_for_backends_that_read_it(
    llama_checkpoint, backend, finds_start
):
    engine = Engine(
        engine_config(
            llama_checkpoint,
            model=dict(max_model_len=64, attention_backend=backend),
            kv_cache=dict(block_size=4, num_blocks=16),
        )
    )
    engine.add_request("r", [1, 5, 9, 3, 7, 2], params=SamplingParams(temperature=0.0, max_tokens=2))
    plan = engine.scheduler.schedule()
    *_, metadata = engine.runner.prepare(plan)
    (chunk,) = metadata.chunks
    blocks = plan.chunks[0].seq.block_table
    assert chunk.block_ids == blocks[:2] and blocks[1] == blocks[0] + 1  # 6 tokens in 2 consecutive blocks
    assert chunk.contiguous_start_slot == (blocks[0] * 4 if finds_start else None)
