"""IncrementalDetokenizer: never raises, and its text is the documented decode of the ids.

Two tokenizer families: the SentencePiece-style byte-fallback tokenizer of stories260K (Metaspace,
"<0xNN>" byte pieces, a ByteFallback decoder that turns a whole invalid byte run into U+FFFD) and
the project's byte-level BPE demo tokenizer (GPT-2/Qwen style, lossy UTF-8 over all bytes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.conftest import STORIES_260K, engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
from tokenloom.engine.outputs.detokenizer import IncrementalDetokenizer
from tokenloom.engine.sample.sampling_params import SamplingParams

BOUNDED = settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _stories_tokenizer() -> Tokenizer:
    path = STORIES_260K / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"stories260K not found at {STORIES_260K}")
    return Tokenizer.from_file(str(path))


@functools.cache
def _byte_level_tokenizer() -> Tokenizer:
    # Hypothesis tests take no function-scoped fixtures, and one trained BPE serves every example.
    return build_tokenizer().backend_tokenizer


@pytest.fixture
def stories() -> Tokenizer:
    return _stories_tokenizer()


@pytest.fixture
def byte_level() -> Tokenizer:
    return _byte_level_tokenizer()


def decoded(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The documented text of `ids`: their decode read as a continuation, behind the anchor "a"."""
    anchor = tokenizer.token_to_id("a")
    head = tokenizer.decode([anchor], skip_special_tokens=False)
    return tokenizer.decode([anchor, *ids], skip_special_tokens=skip_special_tokens)[len(head) :]


def expected_with_stops(
    tokenizer: Tokenizer, ids: list[int], stops: list[str], skip_special_tokens: bool
) -> tuple[str, str | None]:
    """The text cut before the earliest stop in the first prefix of ids whose text holds one."""
    for k in range(1, len(ids) + 1):
        text = decoded(tokenizer, ids[:k], skip_special_tokens)
        hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if hits:
            at, _, stop = min(hits)
            return text[:at], stop
    return decoded(tokenizer, ids, skip_special_tokens), None


def stream(
    tokenizer: Tokenizer, ids: list[int], stops: Sequence[str] = (), skip_special_tokens: bool = True
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids one at a time as the engine does; returns the detokenizer and every delta."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(stops), skip_special_tokens)
    deltas = []
    for token_id in ids:
        detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta(False))
    deltas.append(detokenizer.take_delta(True))
    return detokenizer, deltas


def byte_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """Ids of single-byte tokens spelling `data`: "<0xNN>" pieces, or GPT-2's byte characters."""
    if tokenizer.token_to_id("<0x00>") is not None:
        return [tokenizer.token_to_id(f"<0x{b:02X}>") for b in data]
    return [tokenizer.token_to_id(_GPT2_BYTE_CHARS[b]) for b in data]


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel model's vocabulary spells bytes in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in table)
    for offset, b in enumerate(moved):
        table[b] = chr(256 + offset)
    return table


_GPT2_BYTE_CHARS = _gpt2_byte_chars()


def token_ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Id sequences rich in single bytes (lead, continuation and invalid ones), specials and pieces."""
    size = tokenizer.get_vocab_size()
    singles = byte_ids(tokenizer, bytes(range(256)))
    specials = sorted(tokenizer.get_added_tokens_decoder())
    utf8 = [byte_ids(tokenizer, ch.encode()) for ch in ("é", "中", "😀", "ß")]
    one = st.one_of(
        st.sampled_from(singles).map(lambda t: [t]),
        st.sampled_from(specials).map(lambda t: [t]),
        st.integers(0, size - 1).map(lambda t: [t]),
        st.sampled_from(utf8),
        st.integers(size, size + 8).map(lambda t: [t]),  # a model vocab padded past the tokenizer's
    )
    return st.lists(one, max_size=24).map(lambda chunks: [t for chunk in chunks for t in chunk])


def _check_stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    deltas = []
    for k, token_id in enumerate(ids, start=1):
        detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta(False))
        # `text` is always what the final text would be if the sequence finished now.
        assert detokenizer.text == decoded(tokenizer, ids[:k], skip_special_tokens)
    deltas.append(detokenizer.take_delta(True))
    assert "".join(deltas) == detokenizer.text == decoded(tokenizer, ids, skip_special_tokens)
    assert detokenizer.matched_stop is None
    # Against the plain decode, the anchor only ever restores the leading space it would strip.
    plain = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detokenizer.text in (plain, " " + plain)


def _check_stops(tokenizer: Tokenizer, ids: list[int], stops: list[str], skip_special_tokens: bool) -> None:
    detokenizer, deltas = stream(tokenizer, ids, stops, skip_special_tokens)
    text, stop = expected_with_stops(tokenizer, ids, stops, skip_special_tokens)
    assert "".join(deltas) == detokenizer.text == text
    assert detokenizer.matched_stop == stop


def _stops_for(data: st.DataObject, tokenizer: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """Stop strings that often occur: substrings of the decoded text, plus arbitrary ones."""
    text = decoded(tokenizer, ids, skip)
    substring = st.builds(lambda i, n: text[i : i + n] or "x", st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4))
    return data.draw(st.lists(st.one_of(substring, st.text(min_size=1, max_size=3)), min_size=1, max_size=3))


@BOUNDED
@given(data=st.data(), skip=st.booleans())
def test_byte_fallback_stream_is_the_decode_of_the_ids(data, skip):
    tokenizer = _stories_tokenizer()
    _check_stream(tokenizer, data.draw(token_ids(tokenizer)), skip)


@BOUNDED
@given(data=st.data(), skip=st.booleans())
def test_byte_level_stream_is_the_decode_of_the_ids(data, skip):
    tokenizer = _byte_level_tokenizer()
    ids = data.draw(token_ids(tokenizer))
    _check_stream(tokenizer, ids, skip)
    # The ByteLevel decoder strips nothing, so here the text is exactly the plain decode.
    assert decoded(tokenizer, ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


TOKENIZERS = {"byte_fallback": _stories_tokenizer, "byte_level": _byte_level_tokenizer}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@BOUNDED
@given(data=st.data(), skip=st.booleans())
def test_stop_strings_cut_at_the_first_occurrence(kind, data, skip):
    tokenizer = TOKENIZERS[kind]()
    ids = data.draw(token_ids(tokenizer))
    _check_stops(tokenizer, ids, _stops_for(data, tokenizer, ids, skip), skip)


# --- the shapes that made tokenizers' DecodeStream raise "Invalid prefix encountered" ---


@pytest.mark.parametrize("family", ["stories", "byte_level"])
def test_lone_continuation_byte_is_a_replacement_character(family, request):
    tokenizer = request.getfixturevalue(family)
    hi, ab = (tokenizer.encode(s, add_special_tokens=False).ids for s in ("Hi", "ab"))
    ids = hi + byte_ids(tokenizer, b"\x80") + ab
    detokenizer, deltas = stream(tokenizer, ids)
    assert detokenizer.text == "".join(deltas) == decoded(tokenizer, ids)
    assert detokenizer.text.strip().startswith("Hi\ufffd")


@pytest.mark.parametrize("family", ["stories", "byte_level"])
def test_finishing_inside_a_multibyte_character_flushes_a_replacement_character(family, request):
    tokenizer = request.getfixturevalue(family)
    eos = tokenizer.token_to_id("</s>")
    for tail in ([], [eos]):  # finished by length, or by an EOS token that is then skipped
        hi = tokenizer.encode("Hi", add_special_tokens=False).ids
        ids = hi + byte_ids(tokenizer, "中".encode()[:2]) + tail
        detokenizer, deltas = stream(tokenizer, ids)
        assert all("\ufffd" not in delta for delta in deltas[:-1])  # nothing half-made is streamed early
        assert detokenizer.text == "".join(deltas) == decoded(tokenizer, ids)
        assert detokenizer.text.endswith("\ufffd")


@pytest.mark.parametrize("family", ["stories", "byte_level"])
def test_emoji_over_four_byte_tokens_streams_whole(family, request):
    tokenizer = request.getfixturevalue(family)
    ids = byte_ids(tokenizer, "😀".encode()) + tokenizer.encode(" ok", add_special_tokens=False).ids
    detokenizer, deltas = stream(tokenizer, ids)
    assert [d for d in deltas if d] and all("\ufffd" not in d for d in deltas)
    assert detokenizer.text == "".join(deltas) == decoded(tokenizer, ids)
    assert "😀" in detokenizer.text


@pytest.mark.parametrize("family", ["stories", "byte_level"])
def test_cjk_round_trips(family, request):
    tokenizer = request.getfixturevalue(family)
    ids = tokenizer.encode("中文 and 日本語", add_special_tokens=False).ids
    detokenizer, deltas = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detokenizer.text.strip() == "中文 and 日本語" == tokenizer.decode(ids).strip()


def test_valid_byte_run_made_invalid_by_a_later_byte_matches_the_decoder(stories):
    # ByteFallback renders a whole run as U+FFFD once any byte of it is invalid: "é" then a stray
    # continuation byte is three replacement characters, so "é" must not be streamed early.
    ids = byte_ids(stories, b"\xc3\xa9\xa9")
    detokenizer, deltas = stream(stories, ids)
    assert deltas[:-1] == ["", "", ""]
    assert detokenizer.text == stories.decode(ids) == "\ufffd\ufffd\ufffd"


def test_first_token_keeps_its_leading_space(stories):
    # A plain decode of "▁time" alone drops the space, as it would at the start of a text.
    full = stories.encode("Once upon a time").ids
    prompt = stories.encode("Once upon a").ids
    assert full[: len(prompt)] == prompt and stories.decode(full[len(prompt) :]) == "time"
    detokenizer, deltas = stream(stories, full[len(prompt) :])
    assert detokenizer.text == "".join(deltas) == " time"


def test_stop_string_inside_a_multibyte_run(stories):
    ids = stories.encode("Hi", add_special_tokens=False).ids + byte_ids(stories, "é".encode())
    detokenizer, deltas = stream(stories, ids, stops=["é"])
    assert detokenizer.matched_stop == "é"
    assert detokenizer.text == "".join(deltas) == decoded(stories, ids).split("é")[0]


def test_tokens_after_a_matched_stop_leave_the_text_alone(stories):
    ids = stories.encode("Hi there Lily and Tom", add_special_tokens=False).ids
    detokenizer, deltas = stream(stories, ids, stops=["Lily"])
    assert detokenizer.matched_stop == "Lily"
    assert detokenizer.text == "".join(deltas) == " Hi there "


def test_random_sampling_on_stories260k_never_fails_a_request(stories260k):
    # Temperature 5 draws near-uniform tokens, half of them byte pieces: the shape that failed ~1 in 5.
    engine = Engine(engine_config(stories260k))
    tokenizer = engine.loaded.encoder.backend
    params = [SamplingParams(temperature=5.0, seed=seed, max_tokens=24) for seed in range(40)]
    for request_id, p in enumerate(params):
        engine.add_request(str(request_id), "Once upon a time", params=p)
    deltas: dict[str, list[str]] = {}
    finals = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            deltas.setdefault(output.request_id, []).append(output.outputs[0].new_text)
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    assert len(finals) == len(params)
    for request_id, completion in finals.items():
        assert completion.finish_reason in ("stop", "length"), completion
        assert "".join(deltas[request_id]) == completion.text
        assert completion.text == decoded(tokenizer, completion.token_ids)
