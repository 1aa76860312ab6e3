"""bench-135m: a seeded random-initialised Llama with SmolLM-135M's shape, built on first use."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenloom.engine.demo_model import build_tokenizer
from tokenloom.engine.model_setup import default_cache_dir

BENCH_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)


def bench_135m_checkpoint(dtype: torch.dtype) -> Path:
    name = str(dtype).removeprefix("torch.")
    path = default_cache_dir() / f"bench-135m-{name}"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**BENCH_135M)).to(dtype)
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)  # unused by the benchmark (token-id prompts)
    return path
