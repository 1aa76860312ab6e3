"""bench-moe: a seeded random-initialised Qwen3-MoE with Qwen3-30B-A3B's layout scaled to a CPU.

Qwen3-30B-A3B routes each token to 8 of 128 experts (moe_intermediate 768, hidden 2048, 48 layers,
q/k norms, GQA). Scaled here: hidden 512, 8 layers, 8 heads / 2 KV heads, 8 experts, top-2,
normalised, expert width 512: about 66M parameters, 26M of them active per token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.bench_model import cached_random_checkpoint

BENCH_MOE = dict(
    hidden_size=512,
    intermediate_size=1024,  # the dense MLP width, unused: every layer is routed
    moe_intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=16384,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    initializer_range=0.1,  # wide enough that the routers spread tokens over the experts
    bos_token_id=1,
    eos_token_id=2,
)


def bench_moe_checkpoint(dtype: torch.dtype) -> Path:
    return cached_random_checkpoint("bench-moe", lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**BENCH_MOE)), dtype)
