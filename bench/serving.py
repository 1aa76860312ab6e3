"""W3, serving: Poisson arrivals through the HTTP API with `stream: true`, at two arrival rates,
and the same requests on the same schedule fed to the engine in-process (the overhead ratio).

    python -m bench.serving [--rates 1,4] [--requests 64] [--model PATH]

W3 of ../shared/design/BENCHMARKS.md: prompts uniform 32-256 random token ids, outputs uniform
16-128 tokens (ignore_eos, greedy), arrivals a Poisson process (exponential gaps, fixed seed).

- HTTP: a fresh Postgres database, one `tokenloom worker` and `tokenloom serve` as subprocesses
  (both warmed up before the clock starts); an asyncio client streams POST /v1/completions and
  timestamps every SSE chunk: TTFT = first token chunk - request sent, ITL = gaps between token
  chunks, TPOT = (last - first token chunk) / (tokens - 1), as ARCHITECTURE.md defines them.
- in-process: the same engine configuration behind an EngineHost in this process, requests
  submitted at the same offsets; figures from the engine's own per-request metrics.
Throughput = output tokens / (last response finished - first request sent). Not a test: read the
ratios HTTP / in-process within one run, not the absolute numbers. Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import redis
import torch

from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.queue import ADMIN_PG_URL, ROOT, fresh_database, start_worker
from bench.workloads import BenchRequest, w1_offline_mixed
from tokenloom.engine.cpu.openmp_threads import in_passing_thread
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.loop.engine_host import EngineHost
from tokenloom.engine.models.loader import load_hf_config
from tokenloom.engine.runner.device import cpu_bfloat16_is_faster
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

MAX_MODEL_LEN = 512


@dataclass(slots=True)
class Timing:
    """One request, seconds: measured by the HTTP client, or by the engine for in-process runs."""

    ttft_s: float | None
    tpot_s: float | None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    sent_at: float = 0.0  # perf_counter
    done_at: float = 0.0


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(timings: list[Timing]) -> dict:
    tokens = sum(t.output_tokens for t in timings)
    wall = max(t.done_at for t in timings) - min(t.sent_at for t in timings)
    return {
        "requests": len(timings),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "ttft_s": percentiles([t.ttft_s for t in timings if t.ttft_s is not None]),
        "tpot_s": percentiles([t.tpot_s for t in timings if t.tpot_s is not None]),
        "itl_s": percentiles([gap for t in timings for gap in t.itl_s]),
    }


# --- through the HTTP API ------------------------------------------------------------------------


async def stream_one(client: httpx.AsyncClient, model: str, request: BenchRequest) -> Timing:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    token_times: list[float] = []
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise SystemExit(f"request failed: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                token_times.append(time.perf_counter())
    done = time.perf_counter()
    if len(token_times) != request.max_tokens:
        raise SystemExit(f"expected {request.max_tokens} token chunks, got {len(token_times)}")
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return Timing(token_times[0] - sent, tpot, gaps, len(token_times), sent, done)


async def run_http(base_url: str, key: str, model: str, requests: list[BenchRequest], offsets: list[float]):
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=None, limits=limits
    ) as client:
        start = time.perf_counter()

        async def at(offset: float, request: BenchRequest) -> Timing:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await stream_one(client, model, request)

        return await asyncio.gather(*(at(o, r) for o, r in zip(offsets, requests)))


def start_api(env: dict, port: int, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        api = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(port), "--log-level", "warning"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return api
        except httpx.HTTPError:
            pass
        if api.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"API did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


# --- in-process ----------------------------------------------------------------------------------


def run_in_process(host: EngineHost, requests: list[BenchRequest], offsets: list[float]) -> list[Timing]:
    """Submit each request at its offset from a driver thread; timings are the engine's own."""
    futures, sent_at = [None] * len(requests), [0.0] * len(requests)

    def drive():
        start = time.perf_counter()
        for i, (offset, request) in enumerate(zip(offsets, requests)):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            sent_at[i] = time.perf_counter()
            params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
            futures[i] = host.submit(f"w3-{uuid.uuid4().hex[:8]}", request.prompt_token_ids, params=params)

    driver = threading.Thread(target=drive)
    driver.start()
    driver.join()
    timings = []
    for future, sent in zip(futures, sent_at):
        output = future.result()
        m = output.metrics
        timings.append(Timing(m.ttft_s, m.tpot_s, list(m.itl_s), output.num_output_tokens, sent, sent + m.e2e_s))
    return timings


# --- main ----------------------------------------------------------------------------------------


def table(results: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1000:.0f}"

    rows = [
        "| rate req/s | path | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | output tok/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for rate, paths in results.items():
        for path, s in paths.items():
            cells = [" / ".join(ms(s[m][p]) for p in ("p50", "p90", "p99")) for m in ("ttft_s", "tpot_s", "itl_s")]
            rows.append(f"| {rate} | {path} | {' | '.join(cells)} | {s['output_tok_per_s']:.1f} |")
    ratio = [
        "",
        "| rate req/s | TTFT p50 HTTP / in-process | TPOT p50 HTTP / in-process | throughput HTTP / in-process |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for rate, paths in results.items():
        http, local = paths["http"], paths["in-process"]
        ratio.append(
            f"| {rate} | {http['ttft_s']['p50'] / local['ttft_s']['p50']:.2f}x | "
            f"{http['tpot_s']['p50'] / local['tpot_s']['p50']:.2f}x | "
            f"{http['output_tok_per_s'] / local['output_tok_per_s']:.2f}x |"
        )
    return "\n".join(rows + ratio)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1,4", help="two (or more) arrival rates in requests/s, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="requests per rate (W3 uses 64; fewer to check)")
    parser.add_argument("--model", help="checkpoint directory (default: bench-135m, built on first use)")
    parser.add_argument("--dtype", help="default: bfloat16 if faster on this CPU, else float32")
    parser.add_argument("--database-url", help=f"Postgres URL (default: a fresh database next to {ADMIN_PG_URL})")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/5", help="Redis URL (its db is flushed)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    dtype = args.dtype or ("bfloat16" if cpu_bfloat16_is_faster() else "float32")
    # Built (first use) on a passing thread: the in-process engine runs on its own thread, and an OpenMP
    # team left on this one would slow its every step (engine/cpu/openmp_threads.py).
    checkpoint = (
        Path(args.model) if args.model else in_passing_thread(lambda: bench_135m_checkpoint(getattr(torch, dtype)))
    )
    vocab = load_hf_config(checkpoint).vocab_size if args.model else BENCH_135M["vocab_size"]
    requests = w1_offline_mixed(vocab, seed=args.seed, num_requests=args.requests)  # W3's length distributions
    schedules = {rate: poisson_offsets(rate, len(requests), args.seed + i) for i, rate in enumerate(rates)}
    scheduler = {
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(args.max_num_seqs),
        "TOKENLOOM_SCHEDULER_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
    }
    results: dict[str, dict] = {str(rate): {} for rate in rates}
    warm_up = [BenchRequest([5] * 16, 4)]

    config = (
        load_config(None, env={})
        .replace("model", name=str(checkpoint), dtype=dtype, max_model_len=MAX_MODEL_LEN)
        .replace("scheduler", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    )
    # Built on the engine thread (a factory), as the worker does: one OpenMP team (bench/README, W5).
    host = EngineHost(lambda: Engine(config)).start()
    try:
        run_in_process(host, warm_up, [0.0])
        for rate in rates:
            results[str(rate)]["in-process"] = summarize(run_in_process(host, requests, schedules[rate]))
            print(
                f"in-process, {rate} req/s: {results[str(rate)]['in-process']['output_tok_per_s']:.1f} tok/s",
                flush=True,
            )
    finally:
        host.stop(30)
        del host

    database_url = args.database_url or fresh_database(ADMIN_PG_URL, "tokenloom_bench_w3")
    redis.Redis.from_url(args.broker_url).flushdb()
    key = f"w3-{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_DTYPE": dtype,
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TOKENLOOM_DATABASE_URL": database_url,
        "TOKENLOOM_QUEUE_BROKER_URL": args.broker_url,
        "TOKENLOOM_API_KEY": key,
        "TOKENLOOM_SERVER_MAX_QUEUED_JOBS": "0",
        **scheduler,
    }
    base_url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as workdir:
        worker = start_worker(env, 2 * args.max_num_seqs, Path(workdir) / "worker.log")
        api = start_api(env, args.port, Path(workdir) / "api.log")
        try:
            asyncio.run(run_http(base_url, key, str(checkpoint), warm_up, [0.0]))
            for rate in rates:
                timings = asyncio.run(run_http(base_url, key, str(checkpoint), requests, schedules[rate]))
                results[str(rate)]["http"] = summarize(timings)
                print(f"HTTP, {rate} req/s: {results[str(rate)]['http']['output_tok_per_s']:.1f} tok/s", flush=True)
        finally:
            for process in (api, worker):
                process.terminate()
                process.wait(60)

    device = "cuda" if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(
        f"\nW3 on {checkpoint.name}, {dtype}, {device}, {len(requests)} requests per rate, Poisson arrivals; "
        f"scheduler max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}\n"
    )
    print(table(results))
    out_dir = Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    record = {
        "workload": "W3",
        "model": checkpoint.name,
        "dtype": dtype,
        "device": device,
        "requests": len(requests),
        "args": vars(args),
        "results": results,
    }
    (out_dir / f"serving-{stamp}.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
