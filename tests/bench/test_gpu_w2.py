"""bench/gpu_w2.py's transformers peers, on the transformers installed here."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from transformers import ContinuousBatchingConfig

from bench.gpu_w2 import asked_for_tokens, continuous_batching_config, warmup_requests
from bench.workloads import BenchRequest, w2_offline_large


def test_the_continuous_batching_config_takes_the_page_size_under_the_installed_name():
    """transformers 5.17 (the device's) calls it block_size; later releases page_size."""
    config = continuous_batching_config(page_size=16, max_batch_tokens=8192, num_blocks=40)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert getattr(config, "page_size" if "page_size" in fields else "block_size") == 16
    assert config.max_batch_tokens == 8192 and config.num_blocks == 40


def test_generate_batch_is_credited_only_when_every_request_got_its_tokens():
    requests = [BenchRequest([1, 2], 3), BenchRequest([4], 2)]

    def output(tokens, error=None):
        return SimpleNamespace(generated_tokens=tokens, error=error)

    assert asked_for_tokens(requests, {"req_0": output([5, 6, 7, 8]), "req_1": output([9, 9])}) == 5
    with pytest.raises(RuntimeError, match="failed 1 of 2 requests: inference tensor"):
        asked_for_tokens(requests, {"req_0": output([], "inference tensor"), "req_1": output([9, 9])})
    with pytest.raises(RuntimeError, match="fewer tokens"):
        asked_for_tokens(requests, {"req_0": output([5]), "req_1": output([9, 9])})


def test_the_warm_up_runs_w2s_own_prompts_so_its_steps_take_the_timed_runs_shapes():
    requests = w2_offline_large(1000)
    warmup = warmup_requests(requests)
    assert [r.prompt_token_ids for r in warmup] == [r.prompt_token_ids for r in requests[: len(warmup)]]
    assert len(warmup) >= 16 and all(r.max_tokens <= 8 for r in warmup)
    # Longer prompts than one step's 8,192-token budget in all: several chunks per prefill step.
    assert sum(len(r.prompt_token_ids) for r in warmup) > 8192
