"""The compute limit of this machine for bench-135m: measured GEMM rate at the engine's step shapes.

    python -m bench.roofline [--workload W1] [--dtype auto|float32|bfloat16] [--step-tokens 512]

Two limits, both from timing the model's own linear layers packed the way the engine packs them
(one decoder layer's fused qkv, o, fused gate_up and down, times the layer count; the LM head):

- at the step shapes: the engine's scheduler plans the workload (no model, the same
  max_num_seqs / max_num_batched_tokens), and each step's GEMMs are timed at that step's row count
  (decode-heavy steps have few rows and run GEMMs far below peak); the sum is the fastest this
  schedule could run if attention, norms, RoPE, sampling and Python cost nothing;
- at a full step of `--step-tokens` rows for every token: the peak GEMM rate, what a perfectly
  packed schedule could approach.

output tokens / limit wall = the tokens/s limit; bench/offline.py results are quoted as a fraction
of the first. Not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from bench.bench_model import BENCH_135M
from bench.workloads import WORKLOADS
from engine.cpu_malloc import keep_step_buffers_in_heap
from engine.device import cpu_bfloat16_is_faster
from engine.models.cpu_linear import can_pack, pack_linears
from engine.sequence import FinishReason


def layer_linears(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    c = BENCH_135M
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    qkv_out = hidden + 2 * c["num_key_value_heads"] * head_dim
    decoder = nn.ModuleDict({
        "qkv": nn.Linear(hidden, qkv_out, bias=False), "o": nn.Linear(hidden, hidden, bias=False),
        "gate_up": nn.Linear(hidden, 2 * inter, bias=False), "down": nn.Linear(inter, hidden, bias=False),
    }).to(dtype)
    lm_head = nn.ModuleDict({"lm_head": nn.Linear(hidden, c["vocab_size"], bias=False)}).to(dtype)
    if can_pack(torch.device("cpu"), dtype):
        pack_linears(decoder)
        pack_linears(lm_head)
    return decoder, lm_head


@torch.inference_mode()
def seconds_per_token(modules: nn.Module, rows: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """Time to push `rows` tokens through every linear in `modules`, per token (best of repeats)."""
    inputs = {name: torch.randn(rows, m.in_features, dtype=dtype) for name, m in modules.items()}
    for name, module in modules.items():
        module(inputs[name])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for name, module in modules.items():
            module(inputs[name])
        best = min(best, time.perf_counter() - start)
    return best / rows


def step_shapes(workload: str, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(rows, sampled rows) of every step the engine's scheduler plans for the workload."""
    from engine.block_pool import BlockPool
    from engine.kv_cache_manager import KVCacheManager
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence, SequenceTimes

    requests = WORKLOADS[workload](BENCH_135M["vocab_size"])
    blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in requests)
    scheduler = Scheduler(KVCacheManager(BlockPool(blocks, True), 16), max_num_seqs, max_num_batched_tokens)
    for i, r in enumerate(requests):
        scheduler.add(Sequence(i, str(i), 0, list(r.prompt_token_ids), len(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.max_tokens), SequenceTimes(arrival=float(i))))
    shapes = []
    while scheduler.has_unfinished:
        plan = scheduler.schedule()
        scheduler.advance(plan)
        sampled = [c.seq for c in plan.chunks if c.samples]
        shapes.append((plan.num_batched_tokens, len(sampled)))
        for seq in sampled:
            seq.token_ids.append(3)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
    return shapes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--step-tokens", type=int, default=512, help="rows per GEMM (the engine's max_num_batched_tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args(argv)
    keep_step_buffers_in_heap()  # the engine's malloc settings, so both sides allocate alike
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_bfloat16_is_faster() else "float32")
    dtype = getattr(torch, name)
    decoder, lm_head = layer_linears(dtype)
    layers = BENCH_135M["num_hidden_layers"]
    requests = WORKLOADS[args.workload](BENCH_135M["vocab_size"])
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)

    shapes = step_shapes(args.workload, args.max_num_seqs, args.step_tokens)
    decoder_cache: dict[int, float] = {}
    lm_head_cache: dict[int, float] = {}
    shaped_wall = 0.0
    for rows, sampled in shapes:
        if rows not in decoder_cache:
            decoder_cache[rows] = seconds_per_token(decoder, rows, dtype, repeats=5) * rows * layers
        if sampled and sampled not in lm_head_cache:
            lm_head_cache[sampled] = seconds_per_token(lm_head, sampled, dtype, repeats=5) * sampled
        shaped_wall += decoder_cache[rows] + (lm_head_cache[sampled] if sampled else 0.0)

    decoder_s = seconds_per_token(decoder, args.step_tokens, dtype) * layers
    lm_head_s = seconds_per_token(lm_head, min(args.step_tokens, args.max_num_seqs), dtype)
    # Every generated token but the last is fed back; every generated token is sampled once.
    peak_wall = (prompt_tokens + output_tokens) * decoder_s + output_tokens * lm_head_s
    flops = 2 * sum(m.in_features * m.out_features for m in decoder.values()) * layers
    print(f"{args.workload} on bench-135m, {name}, {torch.get_num_threads()} threads; scheduler max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.step_tokens}")
    print(f"workload: {prompt_tokens:,} prompt + {output_tokens:,} generated tokens in {len(shapes)} steps "
          f"(mean {sum(r for r, _ in shapes) / len(shapes):.0f} rows per step)")
    print(f"peak decoder GEMM rate: {flops / decoder_s / 1e9:.1f} GFLOP/s at {args.step_tokens} rows")
    print(f"limit at the step shapes: {shaped_wall:.2f} s wall, {output_tokens / shaped_wall:.1f} output tok/s")
    print(f"limit at full {args.step_tokens}-row steps: {peak_wall:.2f} s wall, {output_tokens / peak_wall:.1f} output tok/s")
    return output_tokens / shaped_wall

if __name__ == "__main__":
    main()
