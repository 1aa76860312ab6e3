"""The engine's greedy tokens equal transformers' `generate(do_sample=False)`, token for token.

Every family runs 24+ prompts of mixed lengths submitted together under four pressures, on each
CPU attention backend (the C++ kernels auto picks, and the torch reference): a small token budget
(chunked prefill, mixed prefill+decode steps), a tiny KV pool (preemption with recompute; and with
the KV swapped to host memory and back) and shared prompt prefixes (prefix-cache hits); the
scenarios live in tests/engine/oracle_scenarios.py, shared with tests/engine/oracle/test_family_oracle.py.
"""

from __future__ import annotations

import pytest

from tests.conftest import FAMILIES
from tests.engine.oracle_scenarios import (
    SCENARIOS,
    mixed_prompts,
    prompt_kind,
    run_scenario,
    shared_prefix_prompts,
    transformers_reference,
)

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop


@pytest.fixture(scope="module")
def references(family_checkpoints):
    cache = {}

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            prompts = (shared_prefix_prompts if kind == "prefix" else mixed_prompts)(seed=len(family))
            cache[family, kind] = (prompts, transformers_reference(family_checkpoints[family], prompts))
        return cache[family, kind]

    return get


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_transformers_generate(family, scenario, backend, family_checkpoints, references):
    prompts, expected = references(family, prompt_kind(scenario))
    run_scenario(family_checkpoints[family], scenario, backend, prompts, expected)
