"""Which grammar engine constrains decoding here: xgrammar, llguidance and outlines-core, measured
on the same tokenizers and schemas in one run.

For each engine and tokenizer: the time to compile a JSON schema for the vocabulary (what a new
request pays before its first token) and the mean time to compute one step's token bitmask while
walking a valid document token by token (what every constrained sequence pays per token). Engines
that are not installed are listed as such; tokenloom itself needs only the one it uses.

    python -m bench.grammar_engines            # prints a markdown table
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number"},
        },
        "required": ["name", "age", "address", "tags", "score"],
        "additionalProperties": False,
    },
}
DOCUMENTS = {
    "nested": {
        "name": "Ada Lovelace",
        "age": 36,
        "address": {"city": "London", "zip": "W1"},
        "tags": ["red", "blue"],
        "score": 9.5,
    }
}


def trained_tokenizer(vocab_size: int = 32000):
    """A byte-level BPE of a realistic vocabulary size, trained here on Python's own sources (no hub)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        files,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stories_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHARED_TOKENIZER)


def _walk(tokenizer, schema_name):
    """The compact document's tokens as a model would emit them mid-text (after a prefix, so a
    sentencepiece tokenizer adds no leading-space marker), then EOS."""
    document = json.dumps(DOCUMENTS[schema_name], separators=(",", ":"))
    prefix = tokenizer.encode("x", add_special_tokens=False)
    ids = tokenizer.encode("x" + document, add_special_tokens=False)
    assert ids[: len(prefix)] == prefix and tokenizer.decode(ids[len(prefix) :]) == document
    return ids[len(prefix) :] + [tokenizer.eos_token_id]


def bench_xgrammar(tokenizer, schema_name):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    )
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMAS[schema_name]), any_whitespace=False, separators=(",", ":")
    )
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    steps = []
    for token in _walk(tokenizer, schema_name):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        steps.append(time.perf_counter() - start)
        assert matcher.accept_token(token), "xgrammar refused a valid document"
    return compile_s, statistics.mean(steps)


def bench_llguidance(tokenizer, schema_name):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMAS[schema_name], defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llt.allocate_token_bitmask(1, len(tokenizer))
    steps = []
    for token in _walk(tokenizer, schema_name):
        start = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        steps.append(time.perf_counter() - start)
        assert matcher.consume_token(token), f"llguidance refused a valid document: {matcher.get_error()}"
    return compile_s, statistics.mean(steps)


def bench_outlines_core(tokenizer, schema_name):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = tokenizer.eos_token_id
    vocab: dict[str, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos:
            vocab.setdefault(token, []).append(token_id)
    start = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMAS[schema_name]), whitespace_pattern="")
    index = Index(regex, Vocabulary(eos, vocab))
    compile_s = time.perf_counter() - start
    guide = Guide(index)
    steps = []
    for token in _walk(tokenizer, schema_name)[:-1]:
        start = time.perf_counter()
        guide.get_tokens()
        steps.append(time.perf_counter() - start)
        guide.advance(token)
    return compile_s, statistics.mean(steps)


ENGINES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines-core": bench_outlines_core}


def main() -> None:
    tokenizers = {"stories260K (512)": stories_tokenizer(), "byte-level BPE (32,000)": trained_tokenizer()}
    print("| engine | tokenizer (vocab) | compile schema | bitmask per token |")
    print("|---|---|---|---|")
    for engine, bench in ENGINES.items():
        for label, tokenizer in tokenizers.items():
            try:
                compile_s, step_s = bench(tokenizer, "nested")
            except ImportError as exc:
                print(f"| {engine} | {label} | not installed ({exc.name}) | |")
                continue
            except Exception as exc:  # an engine that cannot take this tokenizer is a finding too
                print(f"| {engine} | {label} | failed: {type(exc).__name__}: {str(exc)[:80]} | |")
                continue
            print(f"| {engine} | {label} | {compile_s * 1e3:,.1f} ms | {step_s * 1e6:,.1f} µs |")


if __name__ == "__main__":
    main()
