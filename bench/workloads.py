"""The fixed-seed workloads of ../shared/design/BENCHMARKS.md, as (prompt token ids, output tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def w1_offline_mixed(vocab_size: int, seed: int = 0, num_requests: int = 64) -> list[BenchRequest]:
    """64 requests, prompts uniform 32-256 tokens, outputs uniform 16-128, all at t=0."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 256))], rng.randint(16, 128))
        for _ in range(num_requests)
    ]


def w4_shared_prefix(vocab_size: int, seed: int = 0, num_requests: int = 64) -> list[BenchRequest]:
    """64 requests sharing a 256-token prefix plus 16-64 unique tokens, 32 output tokens each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(256)]
    return [
        BenchRequest(prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 64))], 32)
        for _ in range(num_requests)
    ]


def w2_offline_large(
    vocab_size: int, seed: int = 0, num_requests: int = 256, min_len: int = 100, max_len: int = 1024
) -> list[BenchRequest]:
    """256 requests, prompts and outputs each uniform 100-1024 tokens, all at t=0 (GPU; nano-vllm's
    workload). `min_len`/`max_len` shrink it for a CPU smoke run of the harness."""
    rng = random.Random(seed)
    return [
        BenchRequest(
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))], rng.randint(min_len, max_len)
        )
        for _ in range(num_requests)
    ]


WORKLOADS = {"W1": w1_offline_mixed, "W2": w2_offline_large, "W4": w4_shared_prefix}
