"""Where an engine step's time goes on W1: scheduling, batch preparation, the model forward,
sampling, and the rest (appending tokens, detokenizing, building outputs).

    python -m bench.step_overhead [--dtype auto|float32|bfloat16]

Each phase is timed with perf_counter around the engine's own calls (wrappers installed on this
engine instance only), so the "Python overhead" share (everything but the forward pass) is read
directly; steps with 48+ running sequences are also reported alone (the batch-64 regime).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.workloads import w1_offline_mixed
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.device import cpu_bfloat16_is_faster
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config


def timed(totals: dict, name: str, call):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    args = parser.parse_args(argv)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_bfloat16_is_faster() else "float32")
    checkpoint = bench_135m_checkpoint(getattr(torch, dtype))
    config = (
        load_config(None, env={})
        .replace("model", name=str(checkpoint), dtype=dtype, max_model_len=512)
        .replace("scheduler", max_num_seqs=64, max_num_batched_tokens=512)
    )
    engine = Engine(config)
    engine.generate([[5] * 16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    step_phases: list[tuple[int, dict]] = []
    totals: dict = defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    engine.runner.prepare = timed(totals, "prepare batch", engine.runner.prepare)
    engine.runner.model = timed(totals, "model forward", engine.runner.model)
    engine.sampler.sample = timed(totals, "sample", engine.sampler.sample)
    for i, r in enumerate(w1_offline_mixed(BENCH_135M["vocab_size"])):
        engine.add_request(
            f"r{i}",
            r.prompt_token_ids,
            params=SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True),
        )
    while engine.has_unfinished_requests:
        totals.clear()
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        start = time.perf_counter()
        engine.step()
        totals["step"] = time.perf_counter() - start
        step_phases.append((min(running, 64), dict(totals)))
    for label, rows in (
        ("all steps", step_phases),
        ("steps with >= 48 sequences", [p for p in step_phases if p[0] >= 48]),
    ):
        if not rows:
            continue
        step = sum(p["step"] for _, p in rows)
        phases = ("schedule", "prepare batch", "model forward", "sample")
        shares = {name: sum(p.get(name, 0.0) for _, p in rows) for name in phases}
        shares["outputs, detokenize, rest"] = step - sum(shares.values())
        print(f"\n{label}: {len(rows)} steps, {step / len(rows) * 1000:.1f} ms per step ({dtype})")
        print("| phase | ms per step | share |")
        print("| --- | ---: | ---: |")
        for name, seconds in shares.items():
            print(f"| {name} | {seconds / len(rows) * 1000:.2f} | {seconds / step:.1%} |")
        print(
            f"| Python overhead (all but the forward) | {(step - shares['model forward']) / len(rows) * 1000:.2f} | "
            f"{(step - shares['model forward']) / step:.1%} |"
        )


if __name__ == "__main__":
    main()
