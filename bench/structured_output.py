"""What structured output costs: output tok/s of JSON-schema-constrained requests against the same
requests unconstrained, in one run, on one engine.

The models are random Llamas with a 32,000-token byte-level BPE vocabulary (trained here, see
bench/grammar_engines.py), so the grammar engine masks a realistic vocabulary: `small` (4 layers,
hidden 256) keeps the forward pass cheap, the worst case for the constraint's relative cost; `135m`
has SmolLM-135M's layers. Each configuration runs REPEATS times, round-robin; the table shows medians.

    python -m bench.structured_output [--model small|135m]     # prints a markdown table
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.grammar_engines import trained_tokenizer
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.model_setup import default_cache_dir
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

NUM_REQUESTS = 32
MAX_TOKENS = 64
REPEATS = 3
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 400},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}
SHAPES = {
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=32000,
        max_position_embeddings=1024,
    ),
}


def checkpoint(model: str = "small") -> Path:
    path = default_cache_dir() / ("bench-json-32k" if model == "small" else f"bench-json-32k-{model}")
    if not (path / "config.json").is_file():
        shape = SHAPES[model]
        tokenizer = trained_tokenizer(shape["vocab_size"])
        torch.manual_seed(0)
        config = LlamaConfig(**shape, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def run(engine: Engine, constrained: int) -> float:
    """Output tokens per second of NUM_REQUESTS greedy requests, the first `constrained` under SCHEMA."""
    prompts = [f"Record {i}: a book about" for i in range(NUM_REQUESTS)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMA})
        if i < constrained
        else SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(NUM_REQUESTS)
    ]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(o.num_output_tokens for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    args = parser.parse_args()
    config = load_config(None, env={}).replace("model", name=str(checkpoint(args.model)), dtype="float32")
    engine = Engine(config)
    run(engine, NUM_REQUESTS)  # warm-up: kernels, the grammar compile cache
    cases = {"unconstrained": 0, "half under a JSON schema": NUM_REQUESTS // 2, "all under a JSON schema": NUM_REQUESTS}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(REPEATS):  # round-robin, so a slow spell of the machine hits every case alike
        for name, n in cases.items():
            samples[name].append(run(engine, n))
    results = {name: statistics.median(values) for name, values in samples.items()}
    base = results["unconstrained"]
    print(
        f"| {args.model}: {NUM_REQUESTS} greedy requests, up to {MAX_TOKENS} tokens | output tok/s | vs unconstrained |"
    )
    print("|---|---|---|")
    for name, tok_s in results.items():
        print(f"| {name} | {tok_s:,.0f} | {tok_s / base:.2f}x |")


if __name__ == "__main__":
    main()
