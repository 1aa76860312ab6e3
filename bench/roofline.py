"""The compute limit of this machine for bench-135m: measured GEMM rate at the engine's step shapes.

    python -m bench.roofline [--workload W1] [--dtype auto|float32|bfloat16] [--step-tokens 512]

Two limits, both from timing the model's own linear layers packed the way the engine packs them
(every decoder layer's fused qkv, o, fused gate_up and down, each layer with its own weights as in
the model; the LM head):

- at the step shapes: the engine's scheduler plans the workload (no model, the same
  max_num_seqs / max_num_batched_tokens), and each step's GEMMs are timed at that step's row count
  (decode-heavy steps have few rows and run GEMMs far below peak); the sum is the fastest this
  schedule could run if attention, norms, RoPE, sampling and Python cost nothing;
- at a full step of `--step-tokens` rows for every token: the peak GEMM rate, what a perfectly
  packed schedule could approach.

Why every layer's own weights: a step streams all of the model's weights (bench-135m in float32:
538 MB) through the caches. Timing one decoder layer's GEMMs cache-hot and multiplying by the layer
count would claim few-row steps faster than the weights can be read from memory on a CPU whose cache
holds a layer but not the model. That cache-hot figure is still printed beside the real one, as a
reference for how much of a step is memory-bound.

Where a layer can run more than one GEMM (bfloat16 on an AMX CPU: the brgemm kernel the engine
runs at every row count, and oneDNN's, faster at some shapes of 64+ rows; float32 where torch has
MKL: MKL's packed GEMM and oneDNN's, each on its own packing), each shape is timed with each and
the faster counts: the limit is the machine's, not the engine's choice.

output tokens / limit wall = the tokens/s limit; bench/offline.py results are quoted as a fraction
of the first. Not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from torch import nn

from bench.bench_model import BENCH_135M
from bench.workloads import WORKLOADS
from tokenloom.engine.core.sequence import FinishReason
from tokenloom.engine.cpu import linear as cpu_linear
from tokenloom.engine.cpu.linear import can_pack, pack_linears
from tokenloom.engine.cpu.malloc import keep_step_buffers_in_heap
from tokenloom.engine.runner.device import cpu_bfloat16_is_faster


@dataclass
class PackedModel:
    """The model's linears packed for one float32 GEMM (None: the engine's choice)."""

    decoders: list[nn.Module]  # every decoder layer's, each with its own weights
    lm_head: nn.Module


def packed_models(dtype: torch.dtype, num_layers: int) -> list[PackedModel]:
    """One packing per GEMM the layers can get here: float32 with MKL gets MKL's and oneDNN's."""
    kernels: list[str | None] = [None]
    if dtype == torch.float32 and can_pack(torch.device("cpu"), dtype) and cpu_linear.mkl_packing_available():
        kernels = ["mkl", "onednn"]
    engine_choice = cpu_linear.FLOAT32_GEMM
    models = []
    try:
        for kernel in kernels:
            cpu_linear.FLOAT32_GEMM = kernel
            decoder, lm_head = layer_linears(dtype)
            models.append(PackedModel([decoder] + [layer_linears(dtype)[0] for _ in range(num_layers - 1)], lm_head))
    finally:
        cpu_linear.FLOAT32_GEMM = engine_choice
    return models


def fastest_of(models: list[PackedModel], time_it) -> float:
    """min over the packings of time_it(model) under every GEMM its layers can run (see `fastest`)."""
    return min(fastest(lambda: time_it(model), model.decoders[0]) for model in models)


def layer_linears(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """One decoder layer's linears (fused as the engine fuses them) and the LM head, packed as the engine packs them."""
    c = BENCH_135M
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = hidden // c["num_attention_heads"]
    qkv_out = hidden + 2 * c["num_key_value_heads"] * head_dim
    decoder = nn.ModuleDict(
        {
            "qkv": nn.Linear(hidden, qkv_out, bias=False),
            "o": nn.Linear(hidden, hidden, bias=False),
            "gate_up": nn.Linear(hidden, 2 * inter, bias=False),
            "down": nn.Linear(inter, hidden, bias=False),
        }
    ).to(dtype)
    lm_head = nn.ModuleDict({"lm_head": nn.Linear(hidden, c["vocab_size"], bias=False)}).to(dtype)
    if can_pack(torch.device("cpu"), dtype):
        pack_linears(decoder)
        pack_linears(lm_head)
    return decoder, lm_head


@torch.inference_mode()
def seconds_per_token(modules: nn.Module, rows: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """Time to push `rows` tokens through every linear in `modules`, per token (best of repeats)."""
    return seconds_per_pass([modules], rows, dtype, repeats) / rows


@torch.inference_mode()
def seconds_per_pass(layers: list[nn.Module], rows: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Time to push `rows` tokens through every linear of every layer in order, as a forward does (best of repeats).

    Distinct layers stream their own weights; one layer timed alone keeps its weights in cache."""
    inputs = {name: torch.randn(rows, m.in_features, dtype=dtype) for name, m in layers[0].items()}
    for name, module in layers[0].items():
        module(inputs[name])  # warm-up: oneDNN builds its kernels for this shape once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            for name, module in layer.items():
                module(inputs[name])
        best = min(best, time.perf_counter() - start)
    return best


def fastest(time_it, layers: nn.Module) -> float:
    """time_it() under every GEMM `layers` can run here; the fastest (see the module docstring)."""
    if not any(getattr(m, "brgemm_weight", None) is not None for m in layers.values()):
        return time_it()
    engine_choice = cpu_linear.BRGEMM_MAX_ROWS
    try:
        times = []
        for cap in (engine_choice, 0):  # brgemm at every row count (the engine's), then oneDNN alone
            cpu_linear.BRGEMM_MAX_ROWS = cap
            times.append(time_it())
        return min(times)
    finally:
        cpu_linear.BRGEMM_MAX_ROWS = engine_choice


def step_shapes(workload: str, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(rows, sampled rows) of every step the engine's scheduler plans for the workload."""
    from tokenloom.engine.core.block_pool import BlockPool
    from tokenloom.engine.core.kv_cache_manager import KVCacheManager
    from tokenloom.engine.core.scheduler import Scheduler
    from tokenloom.engine.core.sequence import Sequence, SequenceTimes
    from tokenloom.engine.sample.sampling_params import SamplingParams

    requests = WORKLOADS[workload](BENCH_135M["vocab_size"])
    blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in requests)
    scheduler = Scheduler(KVCacheManager(BlockPool(blocks, True), 16), max_num_seqs, max_num_batched_tokens)
    for i, r in enumerate(requests):
        scheduler.add(
            Sequence(
                i,
                str(i),
                0,
                list(r.prompt_token_ids),
                len(r.prompt_token_ids),
                SamplingParams(max_tokens=r.max_tokens),
                SequenceTimes(arrival=float(i)),
            )
        )
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


@dataclass(frozen=True)
class Limits:
    """Output tokens/s limits for the workload's schedule (GEMMs only)."""

    tok_s: float  # every decoder layer with its own weights: the limit
    cache_hot_tok_s: float  # one decoder layer timed cache-hot x the layer count (an upper bound that ignores memory)


def main(argv=None) -> Limits:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument(
        "--step-tokens", type=int, default=512, help="rows per GEMM (the engine's max_num_batched_tokens)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args(argv)
    keep_step_buffers_in_heap()  # the engine's malloc settings, so both sides allocate alike
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_bfloat16_is_faster() else "float32")
    dtype = getattr(torch, name)
    layers = BENCH_135M["num_hidden_layers"]
    models = packed_models(dtype, layers)
    requests = WORKLOADS[args.workload](BENCH_135M["vocab_size"])
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)

    shapes = step_shapes(args.workload, args.max_num_seqs, args.step_tokens)
    # Both definitions timed shape by shape, one right after the other, so the machine's drift hits both alike.
    decoder_s: dict[int, float] = {}
    cache_hot_s: dict[int, float] = {}
    lm_head_s: dict[int, float] = {}
    for rows, sampled in shapes:
        if rows not in decoder_s:
            decoder_s[rows] = fastest_of(models, lambda m: seconds_per_pass(m.decoders, rows, dtype, repeats=3))
            cache_hot_s[rows] = (
                fastest_of(models, lambda m: seconds_per_pass(m.decoders[:1], rows, dtype, repeats=5)) * layers
            )
        if sampled and sampled not in lm_head_s:
            lm_head_s[sampled] = fastest_of(models, lambda m: seconds_per_pass([m.lm_head], sampled, dtype, repeats=5))
    head_wall = sum(lm_head_s[sampled] for _, sampled in shapes if sampled)
    shaped_wall = sum(decoder_s[rows] for rows, _ in shapes) + head_wall
    cache_hot_wall = sum(cache_hot_s[rows] for rows, _ in shapes) + head_wall

    full_decoder_s = (
        fastest_of(models, lambda m: seconds_per_pass(m.decoders, args.step_tokens, dtype)) / args.step_tokens
    )
    full_lm_head_s = fastest_of(
        models, lambda m: seconds_per_token(m.lm_head, min(args.step_tokens, args.max_num_seqs), dtype)
    )
    # Every generated token but the last is fed back; every generated token is sampled once.
    peak_wall = (prompt_tokens + output_tokens) * full_decoder_s + output_tokens * full_lm_head_s
    flops = 2 * sum(m.in_features * m.out_features for m in models[0].decoders[0].values()) * layers
    print(
        f"{args.workload} on bench-135m, {name}, {torch.get_num_threads()} threads; scheduler max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {args.step_tokens}"
    )
    print(
        f"workload: {prompt_tokens:,} prompt + {output_tokens:,} generated tokens in {len(shapes)} steps "
        f"(mean {sum(r for r, _ in shapes) / len(shapes):.0f} rows per step)"
    )
    print(f"peak decoder GEMM rate: {flops / full_decoder_s / 1e9:.1f} GFLOP/s at {args.step_tokens} rows")
    print(f"limit at the step shapes: {shaped_wall:.2f} s wall, {output_tokens / shaped_wall:.1f} output tok/s")
    print(
        f"limit at full {args.step_tokens}-row steps: {peak_wall:.2f} s wall, {output_tokens / peak_wall:.1f} output tok/s"
    )
    print(
        f"(one cache-hot decoder layer x {layers}, the cache-hot bound: {cache_hot_wall:.2f} s wall, "
        f"{output_tokens / cache_hot_wall:.1f} output tok/s)"
    )
    return Limits(output_tokens / shaped_wall, output_tokens / cache_hot_wall)


if __name__ == "__main__":
    main()
