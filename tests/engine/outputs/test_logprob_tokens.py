"""engine/outputs/logprob_tokens.py: every token spelled with its real bytes (byte-level BPE and SentencePiece
byte fallback), so the bytes of a completion's tokens are its text, and entries keep the engine's values."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.conftest import ORACLE_CONFIG, STORIES_260K, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint, build_tokenizer
from tokenloom.engine.outputs.logprob_tokens import TokenSpeller, speller_for
from tokenloom.engine.sample.sampler import TokenLogprobs
from tokenloom.engine.sample.sampling_params import SamplingParams

TEXT = "Once upon a time: é, ✓ and 🙂 (four bytes)"


def joined_bytes(speller: TokenSpeller, ids: list[int]) -> bytes:
    return b"".join(bytes(speller.spell(i)[1]) for i in ids)


def test_byte_level_tokens_carry_their_real_bytes_even_mid_character():
    tokenizer = build_tokenizer()._tokenizer
    speller = TokenSpeller(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert joined_bytes(speller, ids) == TEXT.encode("utf-8")
    partial = [i for i in ids if len(speller.spell(i)[1]) == 1 and speller.spell(i)[1][0] >= 0x80]
    assert partial, "the demo tokenizer should split the multi-byte characters into byte tokens"
    assert all(speller.spell(i)[0] == "\ufffd" for i in partial)


def test_byte_fallback_tokens_carry_their_byte_and_pieces_read_as_continuations():
    if not (STORIES_260K / "tokenizer.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES_260K} (its tokenizer is the byte-fallback one)")
    tokenizer = Tokenizer.from_file(str(STORIES_260K / "tokenizer.json"))
    speller = TokenSpeller(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    # SentencePiece adds a leading space to the first word ("▁Once"): it reads " Once" here.
    assert joined_bytes(speller, ids) == (" " + TEXT).encode("utf-8")
    assert speller.spell(tokenizer.token_to_id("<0xE2>")) == ("\ufffd", [0xE2])
    assert speller.spell(tokenizer.token_to_id("▁time")) == (" time", list(b" time"))


def test_special_tokens_are_spelled_by_their_content():
    tokenizer = build_tokenizer()._tokenizer
    assert TokenSpeller(tokenizer).spell(tokenizer.token_to_id("</s>")) == ("</s>", list(b"</s>"))


def test_an_entry_keeps_ids_and_logprobs_and_spells_the_alternatives_in_order():
    tokenizer = build_tokenizer()._tokenizer
    speller = speller_for(tokenizer)
    a, b = tokenizer.token_to_id("a"), tokenizer.token_to_id("e")
    entry = speller.entry(TokenLogprobs(token_id=a, logprob=-0.5, top=[(b, -0.25), (a, float("-inf"))]))
    assert entry == {
        "token_id": a,
        "token": "a",
        "bytes": [97],
        "logprob": -0.5,
        "top": [[b, -0.25], [a, None]],  # JSON has no -Infinity
        "top_tokens": [{"token": "e", "bytes": [101]}, {"token": "a", "bytes": [97]}],
    }
    assert speller_for(tokenizer) is speller and speller.entries(None) is None


def test_prompt_entries_spell_every_prompt_token_with_null_logprobs_where_nothing_scored_it():
    """The first token has no predictor; a request aborted mid-prefill has positions the engine never
    scored. Both are entries with `logprob` and `top` null, so the result of a cancelled scoring job
    still has one entry per prompt token."""
    tokenizer = build_tokenizer()._tokenizer
    speller = speller_for(tokenizer)
    a, b, c = (tokenizer.token_to_id(t) for t in ("a", "e", "i"))
    scored = TokenLogprobs(token_id=b, logprob=-1.5, top=[(b, -1.5)])
    entries = speller.prompt_entries([a, b, c], [None, scored, None])
    assert [e["token_id"] for e in entries] == [a, b, c]
    assert entries[1] == speller.entry(scored)
    for unscored, (token_id, text) in ((entries[0], (a, "a")), (entries[2], (c, "i"))):
        assert unscored == {
            "token_id": token_id,
            "token": text,
            "bytes": list(text.encode()),
            "logprob": None,
            "top": None,
            "top_tokens": None,
        }
    assert speller.prompt_entries([a], None) is None


def test_entries_of_a_generation_align_with_its_tokens_and_spell_its_text(tmp_path):
    checkpoint = build_random_checkpoint(tmp_path / "llama", **ORACLE_CONFIG)
    engine = Engine(engine_config(checkpoint))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    output = engine.generate(["Once upon a time"], params)[0].outputs[0]
    speller = speller_for(engine.loaded.encoder.backend)
    entries = speller.entries(output.logprobs)
    assert [e["token_id"] for e in entries] == output.token_ids
    assert [e["logprob"] for e in entries] == [lp.logprob for lp in output.logprobs]
    assert [e["top"] for e in entries] == [[list(pair) for pair in lp.top] for lp in output.logprobs]
    assert all(len(e["top"]) == len(e["top_tokens"]) == 3 for e in entries)
    specials = set(engine.loaded.encoder.backend.get_added_tokens_decoder())
    text_bytes = b"".join(bytes(e["bytes"]) for e in entries if e["token_id"] not in specials)
    assert text_bytes.decode("utf-8", errors="replace") == output.text
