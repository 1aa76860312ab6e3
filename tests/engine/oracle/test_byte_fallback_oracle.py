"""Greedy requests on every family with a byte-fallback (SentencePiece-style) tokenizer all succeed,
their tokens equal transformers' `generate(do_sample=False)`, and their text is the decode of those
tokens as engine/outputs/detokenizer.py defines it.

Random-weight models emit byte tokens (<0x80> alone, lead bytes never completed) all the time: the
detokenizer must turn them into U+FFFD rather than fail the request.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import FAMILIES, ORACLE_CONFIG, STORIES_260K, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

NUM_PROMPTS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@pytest.fixture(scope="module")
def byte_fallback_checkpoints(tmp_path_factory):
    if not (STORIES_260K / "tokenizer.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES_260K} (its tokenizer is the byte-fallback one under test)")
    vocab_size = AutoTokenizer.from_pretrained(STORIES_260K).backend_tokenizer.get_vocab_size()
    root = tmp_path_factory.mktemp("byte-fallback")
    checkpoints = {}
    for seed, (family, spec) in enumerate(FAMILIES.items()):
        path = build_random_checkpoint(root / family, seed=100 + seed, vocab_size=vocab_size, **ORACLE_CONFIG, **spec)
        for stale in path.glob("tokenizer*"):  # the demo tokenizer build_random_checkpoint saved
            stale.unlink()
        for name in TOKENIZER_FILES:
            shutil.copy(STORIES_260K / name, path / name)
        checkpoints[family] = path
    return checkpoints, vocab_size


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_greedy_request_succeeds_and_equals_transformers(family, byte_fallback_checkpoints):
    checkpoints, vocab_size = byte_fallback_checkpoints
    rng = random.Random(family)
    # ids 3..258 are the byte tokens <0x00>..<0xFF>: prompts full of them steer outputs there too.
    prompts = [[1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(NUM_PROMPTS)]
    max_tokens = 16
    engine = Engine(
        engine_config(
            checkpoints[family],
            model=dict(max_model_len=128),
            scheduler=dict(max_num_batched_tokens=64, max_num_seqs=16),
        )
    )
    outputs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens) for _ in prompts])

    model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    # The tokenizer as transformers loads it, like the engine (for model_type qwen2 transformers builds
    # its Qwen2Tokenizer pipeline over these files, whatever tokenizer_config.json names).
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family]).backend_tokenizer
    byte_tokens_seen = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length"), completion.finish_reason
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, pad_token_id=2
            )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected
        generated = [t for t in completion.token_ids if t != 2]
        byte_tokens_seen += sum(3 <= t <= 258 for t in generated)
        # The plain decode, up to the SentencePiece leading space the detokenizer keeps.
        plain = tokenizer.decode(generated, skip_special_tokens=True)
        assert completion.text in (plain, " " + plain), (completion.text, plain)
    assert byte_tokens_seen > 0, "no byte tokens generated: the test would not exercise byte fallback"
