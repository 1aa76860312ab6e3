"""Scoring throughput: prompt log-likelihoods (max_tokens 0, prompt_logprobs) from tokenloom vs
transformers computing the same log-softmax in padded batches, same model, passages and dtype, one
run; and peak memory of scoring one long prompt vs prefilling it without logprobs.

    python -m bench.scoring [--passages 64] [--min-tokens 256] [--max-tokens 1024] [--hf-batch 8]
    python -m bench.scoring --passages 2000 --hf-batch 32   # the issue's passage count, on a GPU

Prints a Markdown table (wall time, prompt tokens scored per second, ratio to transformers) and
the largest difference between the two systems' log-likelihoods, and writes JSON to
bench/results/. Peak memory is the device's allocator peak on CUDA and the process's peak RSS
growth on a CPU. Not a test: speed varies run to run, ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

RESULTS = Path(__file__).parent / "results"


def passages(count: int, min_tokens: int, max_tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_tokens, max_tokens) - 1)]
        for _ in range(count)
    ]


def engine_for(checkpoint: Path, dtype: str, max_model_len: int) -> Engine:
    config = load_config(None, env={}).replace("model", name=str(checkpoint), dtype=dtype, max_model_len=max_model_len)
    return Engine(config)


def score_tokenloom(engine: Engine, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    engine.generate([prompts[0][:32]], params)  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, [[e.logprob for e in o.prompt_logprobs[1:]] for o in outputs]


def score_transformers(
    checkpoint: Path, dtype: torch.dtype, device: str, prompts: list[list[int]], batch_size: int
) -> tuple[float, list[list[float]]]:
    """Padded batches of similar lengths, one forward each, log-softmax gathered per position."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    scores: list[list[float]] = [[] for _ in prompts]
    with torch.inference_mode():
        model(torch.tensor([prompts[0][:32]], device=device))  # warm-up
        start = time.perf_counter()
        for begin in range(0, len(order), batch_size):
            batch = [prompts[i] for i in order[begin : begin + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch], device=device)
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch], device=device)
            logits = model(ids, attention_mask=mask).logits[:, :-1].float()
            chosen = logits.log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0].tolist()
            for row, i in enumerate(order[begin : begin + batch_size]):
                scores[i] = chosen[row][: len(prompts[i]) - 1]
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return wall, scores


def peak_bytes(engine: Engine, prompt: list[int], params: SamplingParams) -> int:
    """Peak memory growth while the engine runs `prompt` alone. On a CPU the process's peak RSS
    only grows, so each measurement runs in a fresh process (`--peak`)."""
    if engine.loaded.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        engine.generate([prompt], params)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    before = _current_rss()
    engine.generate([prompt], params)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def _current_rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


PEAK_PARAMS = {
    "prefill": SamplingParams(max_tokens=1, temperature=0.0),
    "scored": SamplingParams(max_tokens=0, prompt_logprobs=5),
}


def peak_in_new_process(kind: str, args: argparse.Namespace) -> int:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scoring",
            "--peak",
            kind,
            "--long-prompt",
            str(args.long_prompt),
            "--dtype",
            args.dtype,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers' batch size (padded)")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=2047,
        help="tokens of the peak-memory prompt (bench-135m holds 2,048 positions)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--peak", choices=sorted(PEAK_PARAMS), help=argparse.SUPPRESS)  # one measurement, printed
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    checkpoint = bench_135m_checkpoint(dtype)
    vocab = BENCH_135M["vocab_size"]
    long_prompt = passages(1, args.long_prompt, args.long_prompt, vocab, seed=1)[0]
    if args.peak:
        engine = engine_for(checkpoint, args.dtype, args.long_prompt + 1)
        engine.generate([long_prompt[:64]], PEAK_PARAMS[args.peak])  # warm-up
        print(peak_bytes(engine, long_prompt, PEAK_PARAMS[args.peak]))
        return
    prompts = passages(args.passages, args.min_tokens, args.max_tokens, vocab)
    num_scored = sum(len(p) - 1 for p in prompts)

    engine = engine_for(checkpoint, args.dtype, max(args.max_tokens, args.long_prompt) + 1)
    ours_s, ours = score_tokenloom(engine, prompts)
    hf_s, theirs = score_transformers(checkpoint, dtype, device, prompts, args.hf_batch)
    max_diff = max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o, t))

    # Peak memory: the long prompt scored (a logprob per position) vs prefilled with nothing returned.
    if device == "cuda":
        plain, scored = (peak_bytes(engine, long_prompt, PEAK_PARAMS[k]) for k in ("prefill", "scored"))
    else:
        plain, scored = (peak_in_new_process(k, args) for k in ("prefill", "scored"))

    rows = [("tokenloom", ours_s), (f"transformers (batches of {args.hf_batch})", hf_s)]
    print(
        f"{args.passages} passages of {args.min_tokens}-{args.max_tokens} tokens, {num_scored:,} tokens scored, "
        f"{device}, {args.dtype}, {'bench-135m'}"
    )
    print("| system | wall s | scored tok/s | vs transformers |\n|---|---:|---:|---:|")
    for name, wall in rows:
        print(f"| {name} | {wall:.2f} | {num_scored / wall:,.0f} | {hf_s / wall:.2f}x |")
    print(f"max |logprob difference| = {max_diff:.2e}")
    print(
        f"peak memory, one {args.long_prompt}-token prompt: prefill only {plain / 2**20:.1f} MiB, "
        f"with prompt logprobs (top 5) {scored / 2**20:.1f} MiB"
    )
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS / f"scoring-{stamp}.json").write_text(
        json.dumps(
            {
                "args": vars(args),
                "device": device,
                "machine": platform.processor() or platform.machine(),
                "num_scored_tokens": num_scored,
                "tokenloom_s": ours_s,
                "transformers_s": hf_s,
                "max_logprob_diff": max_diff,
                "peak_prefill_bytes": plain,
                "peak_scored_bytes": scored,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
