"""engine/outputs/compact_prompt_logprobs.py: prompt logprobs stored once per field and spelled once per
token, expanded into exactly the entries clients got before (TokenSpeller.prompt_entries)."""

from __future__ import annotations

import json
import random

import pytest

from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
from tokenloom.engine.outputs.compact_prompt_logprobs import compact_prompt_logprobs, expand_prompt_logprobs
from tokenloom.engine.outputs.logprob_tokens import speller_for
from tokenloom.engine.sample.sampler import TokenLogprobs


def _scored_prompt(rng: random.Random, vocab: int, length: int, k: int, unscored_from: int | None = None):
    prompt = [rng.randrange(vocab) for _ in range(length)]
    logprobs: list[TokenLogprobs | None] = []
    for position, token_id in enumerate(prompt):
        if unscored_from is not None and position >= unscored_from:
            logprobs.append(None)  # aborted mid-prefill: never scored
            continue
        top = sorted(((rng.randrange(vocab), -rng.random() * 10) for _ in range(k)), key=lambda t: -t[1])
        value = float("-inf") if position == 3 else -rng.random() * 12
        logprobs.append(TokenLogprobs(token_id=token_id, logprob=value, top=top))
    return prompt, logprobs


@pytest.mark.parametrize(("k", "unscored_from"), [(0, None), (1, None), (5, None), (20, None), (5, 40)])
def test_expanded_entries_equal_the_entries_clients_got(k, unscored_from):
    speller = speller_for(build_tokenizer()._tokenizer)
    prompt, logprobs = _scored_prompt(random.Random(k), 384, 64, k, unscored_from)
    stored = compact_prompt_logprobs(speller, prompt, logprobs)
    # Through the database's JSON and back, as a row's column goes.
    assert expand_prompt_logprobs(json.loads(json.dumps(stored))) == speller.prompt_entries(prompt, logprobs)


def test_stored_compactly_it_is_several_times_smaller():
    speller = speller_for(build_tokenizer()._tokenizer)
    for k, at_least in [(0, 3), (5, 2), (20, 2)]:
        prompt, logprobs = _scored_prompt(random.Random(1), 384, 2000, k)
        entries = len(json.dumps(speller.prompt_entries(prompt, logprobs)))
        compact = len(json.dumps(compact_prompt_logprobs(speller, prompt, logprobs)))
        assert entries / compact >= at_least, (k, entries / compact)


def test_none_and_rows_stored_as_entry_lists_come_back_as_they_are():
    speller = speller_for(build_tokenizer()._tokenizer)
    assert compact_prompt_logprobs(speller, [1, 2], None) is None
    assert expand_prompt_logprobs(None) is None
    entries = [{"token_id": 1, "token": "<s>", "bytes": [60], "logprob": None, "top": None, "top_tokens": None}]
    assert expand_prompt_logprobs(entries) is entries


def test_an_unknown_stored_format_is_refused_by_name():
    with pytest.raises(ValueError, match="tokenloom.prompt_logprobs.v9"):
        expand_prompt_logprobs({"format": "tokenloom.prompt_logprobs.v9"})
