"""KV memory efficiency on W1: bytes held per cached token vs the ideal, and how many sequences a
fixed KV budget holds with paged blocks vs transformers' static cache.

    python -m bench.memory [--block-size 16] [--budget-gib 1.0]

Runs W1 through the engine (bench-135m shape) and, after every step, compares the KV bytes held
by running sequences (their blocks x block_size x bytes per token) with the bytes their cached
tokens need: the overhead is only each sequence's partly filled last block. A static cache (what
`generate` with a preallocated cache does) reserves prompt + max_new_tokens for every sequence,
padded to the longest in its batch. Deterministic: not a speed measurement.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.workloads import w1_offline_mixed
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.kv_plan import kv_bytes_per_token
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget-gib", type=float, default=1.0, help="KV budget for the fit comparison")
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    checkpoint = bench_135m_checkpoint(torch.float32)
    config = (
        load_config(None, env={})
        .replace("model", name=str(checkpoint), dtype="float32", max_model_len=512)
        .replace("kv_cache", block_size=args.block_size)
        .replace("scheduler", max_num_seqs=64, max_num_batched_tokens=256)
    )
    engine = Engine(config)
    requests = w1_offline_mixed(BENCH_135M["vocab_size"], num_requests=args.requests)
    for i, r in enumerate(requests):
        engine.add_request(
            f"r{i}",
            r.prompt_token_ids,
            params=SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
        )
    ratios = []
    while engine.has_unfinished_requests:
        engine.step()
        running = engine.scheduler.running
        cached = sum(seq.num_computed_tokens for seq in running)
        held = sum(len(seq.block_table) for seq in running) * args.block_size
        if cached:
            ratios.append(held / cached)
    bytes_per_token = kv_bytes_per_token(engine.loaded.shape, engine.kv_dtype)
    budget_tokens = int(args.budget_gib * 2**30) // bytes_per_token
    actual = [len(r.prompt_token_ids) + r.max_tokens for r in requests]
    paged = [-(-n // args.block_size) * args.block_size for n in actual]
    static16 = [max(actual[i : i + 16]) for i in range(0, len(actual), 16) for _ in actual[i : i + 16]]
    print(
        f"W1 ({len(requests)} requests), bench-135m shape, {bytes_per_token:,} KV bytes per token, "
        f"block_size {args.block_size}"
    )
    print(
        f"KV bytes held / bytes needed by cached tokens, over {len(ratios)} steps: "
        f"mean {statistics.mean(ratios):.3f}, max {max(ratios):.3f} (1.000 = ideal)"
    )
    print(f"\nsequences of this workload that fit {args.budget_gib:g} GiB of KV at once (mean length):")
    print("| cache | tokens reserved per sequence | sequences that fit |")
    print("| --- | ---: | ---: |")
    for name, reserved in (
        ("ideal (exact tokens)", actual),
        (f"tokenloom paged ({args.block_size}-token blocks)", paged),
        ("static, padded to batch-16 max", static16),
        ("static, max_model_len 512 each", [512] * len(actual)),
    ):
        mean = statistics.mean(reserved)
        print(f"| {name} | {mean:,.0f} | {budget_tokens / mean:,.0f} |")


if __name__ == "__main__":
    main()
