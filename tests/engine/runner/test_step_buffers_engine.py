"""Whole engine runs with the CUDA step buffers (here on CPU tensors) give the same greedy tokens
as the plain CPU path: with the CPU backend, whose decode kernel reads the step's block table, and
with the Triton kernels (triton's interpreter; checked against the torch reference, as in
test_triton_engine.py). Meanwhile sequences of different lengths finish at different steps (the
later chunks move up a row, their slots stay), block tables grow across block boundaries, later
prompts start on cached prefix blocks, and a small pool preempts sequences (which come back on
other blocks)."""

from __future__ import annotations

import pytest

from tests.conftest import engine_config
from tests.engine.triton_support import DEVICE, RUNS_IN_INTERPRETER
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.copy_fence import NoCopyFence
from tokenloom.engine.runner.step_buffers import StepBuffers, StepLimits
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

SHARED_PREFIX = [1, 7, 7, 3, 9, 4, 4, 8, 2]  # two full blocks of 4: prefix-cache hits for later prompts
PROMPTS = [[1, 5 + i, 9, 2 * i + 3] * (1 + i % 5) for i in range(10)] + [SHARED_PREFIX + [i] for i in range(3)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 4), ignore_eos=True) for i in range(13)]


def with_step_buffers(engine: Engine) -> Engine:
    scheduler, runner = engine.config.scheduler, engine.runner
    limits = StepLimits(
        max_num_tokens=max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs),
        max_num_seqs=scheduler.max_num_seqs,
        max_blocks_per_seq=-(-engine.max_model_len // runner.block_size),
    )
    runner.step_buffers = StepBuffers(limits, runner.device, NoCopyFence(), pin_memory=False)
    return engine


ROOMY, PREEMPTING = dict(block_size=4), dict(block_size=4, num_blocks=24)
TRITON_RUNS = DEVICE.type == "cuda" or RUNS_IN_INTERPRETER


@pytest.mark.parametrize(
    "backend, kv_cache",
    [
        ("cpu", ROOMY),
        ("cpu", PREEMPTING),
        pytest.param("triton", PREEMPTING, marks=pytest.mark.skipif(not TRITON_RUNS, reason="no triton runtime")),
    ],
    ids=["cpu roomy pool", "cpu preempting pool", "triton preempting pool"],
)
def test_greedy_tokens_through_the_step_buffers_equal_the_plain_path(llama_checkpoint, backend, kv_cache):
    def config(attention_backend: str):
        return engine_config(
            llama_checkpoint,
            model=dict(max_model_len=96, attention_backend=attention_backend),
            kv_cache=kv_cache,
            scheduler=dict(max_num_seqs=6, max_num_batched_tokens=64),
        )

    expected = Engine(config("torch" if backend == "triton" else backend)).generate(PROMPTS, PARAMS)
    engine = with_step_buffers(Engine(config(backend)))
    actual = engine.generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in expected]
    counters = engine.counters  # the runs take the paths the docstring names
    assert counters.num_preemptions > 0 if kv_cache is PREEMPTING else counters.prefix_cache_hits > 0
