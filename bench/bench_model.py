"""bench-135m: a seeded random-initialised Llama with SmolLM-135M's shape, built on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
from tokenloom.engine.runner.model_setup import default_cache_dir

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
    return cached_random_checkpoint("bench-135m", lambda: LlamaForCausalLM(LlamaConfig(**BENCH_135M)), dtype)


def cached_random_checkpoint(prefix: str, build_model: Callable[[], torch.nn.Module], dtype: torch.dtype) -> Path:
    """`<cache>/<prefix>-<dtype>`: the model `build_model` makes under seed 0, saved on first use
    with the demo tokenizer (unused by the benchmarks, whose prompts are token ids)."""
    path = default_cache_dir() / f"{prefix}-{str(dtype).removeprefix('torch.')}"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        build_model().to(dtype).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    return path
