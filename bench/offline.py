"""Offline throughput: tokenloom vs transformers on W1 / W4, same model, prompts and dtype, one run.

    python -m bench.offline --workload W1 [--systems tokenloom,hf-static-16,hf-static-64,hf-generate-batch] [--repeats 5]
    python -m bench.offline --workload W1 --model bench-moe --no-roofline   # a mixture-of-experts model

Prints a Markdown table (wall time, output tok/s, ratio to the best transformers peer) and writes
JSON to bench/results/. Not a test: speed varies run to run, ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench import roofline
from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.bench_moe_model import BENCH_MOE, bench_moe_checkpoint
from bench.peers import hf_generate_batch, hf_generate_static
from bench.workloads import WORKLOADS, BenchRequest
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.device import cpu_bfloat16_is_faster
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

ALL_SYSTEMS = ("tokenloom", "hf-static-16", "hf-static-64", "hf-generate-batch")
# Not in the default set: tokenloom with automatic prefix caching off (W4 compares it with "tokenloom").
NO_PREFIX_CACHE = "tokenloom-no-prefix-cache"
MODELS = {  # --model: (checkpoint builder, vocab size)
    "bench-135m": (bench_135m_checkpoint, BENCH_135M["vocab_size"]),
    "bench-moe": (bench_moe_checkpoint, BENCH_MOE["vocab_size"]),
}


def run_tokenloom(
    checkpoint: Path, dtype: str, requests: list[BenchRequest], overrides: dict
) -> tuple[float, dict, list[list[int]]]:
    config = load_config(None, env={}).replace("model", name=str(checkpoint), dtype=dtype, max_model_len=512)
    for section, changes in overrides.items():
        config = config.replace(section, **changes)
    engine = Engine(config)
    engine.generate([[5] * 16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    engine.counters.__init__()
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == r.max_tokens for t, r in zip(tokens, requests))
    c = engine.counters
    extra = {
        "steps": c.num_steps,
        "mean_batch_seqs": round(c.mean_batch_seqs, 1),
        "prefix_cache_hit_rate": round(c.prefix_cache_hit_rate, 3),
        "preemptions": c.num_preemptions,
    }
    return wall, extra, tokens


def run_peer(name: str, checkpoint: Path, dtype: torch.dtype, requests: list[BenchRequest]) -> float:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    hf_generate_static(model, [BenchRequest([5] * 16, 4)], 1)  # warm-up
    start = time.perf_counter()
    if name == "hf-generate-batch":
        hf_generate_batch(model, requests)
    else:
        hf_generate_static(model, requests, int(name.rsplit("-", 1)[1]))
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 only if this CPU multiplies it faster than float32",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the engine's default; on the 2-core EPYC of bench/README.md with the C++ CPU kernels "
        "W1 ran 239 tok/s at 512, 210-219 at 256, 236 at 1024",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="bench-135m",
        help="bench-moe: a random Qwen3-MoE (8 experts, top-2); bench/roofline.py times bench-135m "
        "only, so pass --no-roofline with it",
    )
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip timing this machine's GEMM limit (bench/roofline.py, ~40 s) after the systems",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time tokenloom and the roofline N times, back to back in pairs (the peers once): "
        "the table shows the medians and each pair's roofline fraction is printed, because "
        "on a shared machine the two drift between minutes",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if cpu_bfloat16_is_faster() else "float32"
    dtype = getattr(torch, dtype_name)
    if args.model != "bench-135m" and not args.no_roofline:
        parser.error(f"bench/roofline.py models bench-135m only: add --no-roofline for --model {args.model}")
    build_checkpoint, vocab_size = MODELS[args.model]
    checkpoint = build_checkpoint(dtype)
    requests = WORKLOADS[args.workload](vocab_size)
    output_tokens = sum(r.max_tokens for r in requests)
    rows = []
    tokens_by_system = {}
    measure_limit = partial(
        roofline.main,
        [
            "--workload",
            args.workload,
            "--dtype",
            dtype_name,
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--step-tokens",
            str(args.max_num_batched_tokens),
        ],
    )
    pairs: list[tuple[float, roofline.Limits]] = []  # (tokenloom wall, roofline limits), timed back to back
    for system in args.systems.split(","):
        extra = {}
        if system in ("tokenloom", NO_PREFIX_CACHE):
            overrides = {
                "scheduler": dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
            }
            if system == NO_PREFIX_CACHE:
                overrides["kv_cache"] = dict(enable_prefix_caching=False)
            wall, extra, tokens_by_system[system] = run_tokenloom(checkpoint, dtype_name, requests, overrides)
            if system == "tokenloom" and args.repeats > 1 and not args.no_roofline:
                pairs.append((wall, measure_limit()))
                for _ in range(args.repeats - 1):
                    pairs.append((run_tokenloom(checkpoint, dtype_name, requests, overrides)[0], measure_limit()))
                wall = statistics.median(w for w, _ in pairs)
        else:
            wall = run_peer(system, checkpoint, dtype, requests)
        rows.append(
            {"system": system, "wall_s": round(wall, 2), "output_tok_s": round(output_tokens / wall, 1), **extra}
        )
        print(f"{system}: {wall:.1f} s, {output_tokens / wall:.1f} output tok/s {extra or ''}", flush=True)
    if len(tokens_by_system) == 2:  # prefix caching on vs off: same greedy tokens?
        same = sum(a == b for a, b in zip(tokens_by_system["tokenloom"], tokens_by_system[NO_PREFIX_CACHE]))
        print(f"prefix caching on vs off: identical greedy outputs for {same}/{len(requests)} requests")
    limit = None
    if pairs:
        limit = statistics.median(l.tok_s for _, l in pairs)
        for label, of in (("roofline", lambda l: l.tok_s), ("cache-hot roofline", lambda l: l.cache_hot_tok_s)):
            fractions = sorted(output_tokens / w / of(l) for w, l in pairs)
            print(
                f"tokenloom / {label} per back-to-back pair: {', '.join(f'{f:.0%}' for f in fractions)} "
                f"(median {statistics.median(fractions):.0%})"
            )
    elif not args.no_roofline:  # the same schedule's GEMM-only limit, measured in this run
        limit = measure_limit().tok_s
    report(args.workload, dtype_name, requests, rows, limit, args.model)


def report(
    workload: str,
    dtype: str,
    requests: list[BenchRequest],
    rows: list[dict],
    limit: float | None,
    model: str = "bench-135m",
) -> None:
    peers = [r for r in rows if not r["system"].startswith("tokenloom")]
    best_peer = max(peers, key=lambda r: r["output_tok_s"], default=None)
    ours = next((r for r in rows if r["system"] == "tokenloom"), None)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\n{workload} on {model}, {dtype}, CPU ({torch.get_num_threads()} threads), "
        f"{len(requests)} requests, {sum(r.max_tokens for r in requests)} output tokens, peak RSS {peak_rss_mib:,.0f} MiB\n"
    )
    print("| system | wall s | output tok/s | vs best transformers | of the roofline limit |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        ratio = f"{row['output_tok_s'] / best_peer['output_tok_s']:.2f}x" if best_peer else "-"
        of_limit = f"{row['output_tok_s'] / limit:.0%}" if limit else "-"
        print(f"| {row['system']} | {row['wall_s']} | {row['output_tok_s']} | {ratio} | {of_limit} |")
    if limit:
        print(
            f"\nroofline limit (bench/roofline.py, GEMMs only at this schedule's step shapes): {limit:.1f} output tok/s"
        )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": workload,
        "dtype": dtype,
        "model": model,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "rows": rows,
        "ratio_vs_best_peer": ours and best_peer and round(ours["output_tok_s"] / best_peer["output_tok_s"], 2),
        "peak_rss_mib": round(peak_rss_mib),
        "roofline_limit_tok_s": limit and round(limit, 1),
    }
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    suffix = "" if model == "bench-135m" else f"-{model}"
    (out_dir / f"offline-{workload}{suffix}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
