"""Classes of work under load (docs/priority.md), on a real trained model, through the real stack.

    python -m bench.priority [--lines 96] [--max-tokens 64] [--chats 6] [--tenant-lines 96]

One fresh Postgres database, Redis, one `tokenloom worker` and `tokenloom serve` (subprocesses),
the SmolLM2-135M-Instruct demo checkpoint (engine/models/demo/smollm2.py), greedy, float32. Clients are
the `openai` SDK (streamed chat completions; TTFT = first content chunk - request sent) and
`submit_file` (the path of `tokenloom submit`). Parts, in one run:

1. idle: --chats streamed chat requests one after another on the idle stack (the peer);
2. batch alone: --lines batch lines (--max-tokens each), submit to last row terminal;
3. batch + chats: the same batch again; once the worker holds a full claim window of it, the same
   chat requests one after another: their TTFT against idle (the issue's bound: worst <= 3 x idle
   median or idle + 1 s), the batch's wall time against part 2 (its growth against the chats' own
   time on the idle stack), and the batch's greedy outputs against part 2's (identical);
4. two tenants: --tenant-lines lines for project a, then the same for project b; completed lines
   sampled every 0.25 s: the ratio b / a while both run (from b's first finished line until either
   batch ends);
5. a steady chat stream (--max-num-seqs clients, each sending its next chat as its last ends: alone it
   fills the engine) for --stream-s seconds, then the same stream while --stream-lines batch lines run
   to their end: the chats' TTFT in both phases (the bound: median with the batch <= 3 x alone, or
   alone + 1 s), and the batch's lines per second against part 2's rate alone (its guaranteed share,
   [scheduler] min_seat_share of the seats, is the floor).
Not a test: read the ratios within this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis
from openai import OpenAI
from sqlalchemy import func, select

from bench.queue import ADMIN_PG_URL, fresh_database, start_worker, worker_env
from bench.serving import start_api
from tokenloom.engine.config.cache_dir import default_cache_dir
from tokenloom.engine.models.demo.smollm2 import smollm2_checkpoint
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_service import submit_file
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobStatus

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TOPICS = ("a lighthouse", "a lost key", "the first snow", "a robot", "a garden", "the sea", "a library", "a kite")
CHATS = (
    "What is the capital of France?",
    "Name three colours.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "What day comes after Monday?",
)


def batch_lines(n: int, max_tokens: int, prefix: str, spread: bool = False) -> list[dict]:
    """`spread`: output lengths vary from max_tokens / 2 to max_tokens, as real batch lines' do."""
    return [
        {
            "custom_id": f"{prefix}{i}",
            "prompt": f"Write a short story about {TOPICS[i % len(TOPICS)]}, part {i}.",
            "max_tokens": max_tokens // 2 + (i * 7) % (max_tokens // 2 + 1) if spread else max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


def submit(sessions, app, model: str, lines: list[dict], project: str, group_size: int) -> uuid.UUID:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as file:
        file.write("".join(json.dumps(line) + "\n" for line in lines))
    return submit_file(sessions, app, Path(file.name), model, project, group_size=group_size).batch_id


def count(sessions, batch_id: uuid.UUID, statuses) -> int:
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(Job).where(Job.batch_id == batch_id, Job.status.in_(statuses))
        ).scalar_one()


def wait_done(sessions, batch_id: uuid.UUID, total: int) -> None:
    while count(sessions, batch_id, TERMINAL_JOB_STATUSES) < total:
        time.sleep(0.05)


def outputs(sessions, batch_id: uuid.UUID) -> dict[str, list[int]]:
    with sessions() as session:
        jobs = session.execute(select(Job).where(Job.batch_id == batch_id)).scalars().all()
    if any(job.status is not JobStatus.SUCCEEDED for job in jobs):
        raise SystemExit("a batch line did not succeed")
    return {job.custom_id: job.output_token_ids for job in jobs}


def chat(client: OpenAI, model: str, text: str) -> tuple[float, float]:
    """(TTFT s, end-to-end s) of one streamed chat completion."""
    sent = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0, stream=True
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - sent
    return first if first is not None else float("nan"), time.perf_counter() - sent


def timed_batch(sessions, app, model, lines, group_size, project="default") -> tuple[uuid.UUID, float]:
    start = time.perf_counter()
    batch_id = submit(sessions, app, model, lines, project, group_size)
    wait_done(sessions, batch_id, len(lines))
    return batch_id, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chats", type=int, default=len(CHATS))
    parser.add_argument("--tenant-lines", type=int, default=256)
    parser.add_argument("--tenant-max-tokens", type=int, default=24)
    parser.add_argument("--tenants-only", action="store_true", help="part 4 alone")
    parser.add_argument("--stream-only", action="store_true", help="part 5 alone (with part 2 for its rate)")
    parser.add_argument("--stream-s", type=float, default=20.0)
    parser.add_argument("--stream-lines", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/6", help="Redis URL (its db is flushed)")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args(argv)

    checkpoint = smollm2_checkpoint(default_cache_dir())
    database_url = fresh_database(ADMIN_PG_URL, "tokenloom_bench_priority")
    redis.Redis.from_url(args.broker_url).flushdb()
    key = f"bench-{uuid.uuid4().hex}"
    env = {
        **worker_env(
            checkpoint,
            "float32",
            database_url,
            args.broker_url,
            {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": 512},
            1024,
        ),
        "TOKENLOOM_QUEUE_GROUP_SIZE": str(args.group_size),
        "TOKENLOOM_API_KEY": key,
    }
    RESULTS.mkdir(exist_ok=True)
    worker = start_worker(env, 4, RESULTS / "priority-worker.log")
    api = start_api(env, args.port, RESULTS / "priority-api.log")
    sessions = make_session_factory(make_sql_engine(database_url))
    app = make_celery(args.broker_url)
    client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key=key)
    model = client.models.list().data[0].id
    prompts = [CHATS[i % len(CHATS)] for i in range(args.chats)]
    lines = batch_lines(args.lines, args.max_tokens, "line")
    try:
        chat(client, model, "Warm up.")
        timed_batch(sessions, app, str(checkpoint), batch_lines(4, 4, "warm"), args.group_size)
        result: dict = {
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, float32)",
            "max_num_seqs": args.max_num_seqs,
        }
        if args.stream_only:
            result.update(_stream_part(args, sessions, app, client, model, str(checkpoint)))
            return _report(result)
        if not args.tenants_only:
            result.update(_interactive_parts(args, sessions, app, client, model, str(checkpoint), prompts, lines))
            result.update(_stream_part(args, sessions, app, client, model, str(checkpoint)))
        tenant_lines = {
            name: batch_lines(args.tenant_lines, args.tenant_max_tokens, name, spread=True) for name in ("a", "b")
        }
        a = submit(sessions, app, str(checkpoint), tenant_lines["a"], "tenant-a", args.group_size)
        b = submit(sessions, app, str(checkpoint), tenant_lines["b"], "tenant-b", args.group_size)
        samples = _tenant_samples(sessions, a, b, args.tenant_lines)
    finally:
        api.terminate()
        worker.terminate()
        api.wait(60)
        worker.wait(60)
    result.update(
        {
            "tenant_lines": args.tenant_lines,
            "tenant_max_tokens": f"{args.tenant_max_tokens // 2}-{args.tenant_max_tokens}",
            # While both run: from b's first finished line until either batch ends; and the same once b
            # has finished one claim window (a's head start: 2 x max_num_seqs lines claimed before b existed).
            "tenant_ratio_b_over_a": _ratio_range(samples, 0),
            "tenant_ratio_after_head_start": _ratio_range(samples, 2 * args.max_num_seqs),
        }
    )
    _report(result)


def _report(result: dict) -> None:
    (RESULTS / "priority.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _stream_part(args, sessions, app, client, model: str, checkpoint: str) -> dict:
    """Part 5: a chat stream that alone fills the engine, then the same stream with a batch under it."""
    lines = batch_lines(args.stream_lines, args.max_tokens, "stream-line")
    _, alone_s = timed_batch(sessions, app, checkpoint, lines, args.group_size)
    phase = ["alone"]
    ttfts: dict[str, list[float]] = {"alone": [], "with_batch": []}
    stop = threading.Event()

    def client_loop(index: int) -> None:
        while not stop.is_set():
            name = phase[0]
            ttft, _ = chat(client, model, CHATS[index % len(CHATS)])
            ttfts[name].append(ttft)

    clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.max_num_seqs)]
    for thread in clients:
        thread.start()
    try:
        time.sleep(args.stream_s)
        phase[0] = "with_batch"
        _, with_stream_s = timed_batch(sessions, app, checkpoint, lines, args.group_size)
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    alone_median = statistics.median(ttfts["alone"])
    during_median = statistics.median(ttfts["with_batch"])
    quantile = lambda values: statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]  # noqa: E731
    return {
        "stream_clients": args.max_num_seqs,
        "stream_lines": args.stream_lines,
        "stream_ttft_alone_ms": {
            "median": round(alone_median * 1000, 1),
            "p90": round(quantile(ttfts["alone"]) * 1000, 1),
            "n": len(ttfts["alone"]),
        },
        "stream_ttft_with_batch_ms": {
            "median": round(during_median * 1000, 1),
            "p90": round(quantile(ttfts["with_batch"]) * 1000, 1),
            "n": len(ttfts["with_batch"]),
        },
        "stream_ttft_median_with_batch_over_alone": round(during_median / alone_median, 2),
        "stream_ttft_within_bound": during_median <= max(3 * alone_median, alone_median + 1.0),
        "stream_batch_alone_s": round(alone_s, 2),
        "stream_batch_under_stream_s": round(with_stream_s, 2),
        # The batch's rate under the stream as a share of its rate alone; the guarantee's floor is
        # min_seat_share (0.1 by default) when the batch alone would use every seat.
        "stream_batch_rate_share": round(alone_s / with_stream_s, 3),
    }


def _interactive_parts(args, sessions, app, client, model: str, checkpoint: str, prompts, lines) -> dict:
    """Parts 1-3: idle chats, the batch alone, the batch with the same chats during it."""
    idle = [chat(client, model, text) for text in prompts]
    alone_id, alone_s = timed_batch(sessions, app, checkpoint, lines, args.group_size)
    print(
        f"idle TTFT median {statistics.median(t for t, _ in idle) * 1000:.0f} ms; batch alone {alone_s:.1f} s",
        flush=True,
    )
    during: list[tuple[float, float]] = []
    box: dict = {}
    runner = threading.Thread(
        target=lambda: box.update(zip(("id", "s"), timed_batch(sessions, app, checkpoint, lines, args.group_size)))
    )
    runner.start()
    while not box and _running(sessions) < 2 * args.max_num_seqs:  # the worker's claim window is full
        time.sleep(0.05)
    for text in prompts:
        during.append(chat(client, model, text))
    runner.join()
    idle_ttft = statistics.median(t for t, _ in idle)
    worst = max(t for t, _ in during)
    return {
        "lines": args.lines,
        "max_tokens": args.max_tokens,
        "idle_ttft_ms": [round(t * 1000, 1) for t, _ in idle],
        "during_ttft_ms": [round(t * 1000, 1) for t, _ in during],
        "worst_during_over_idle_median": round(worst / idle_ttft, 2),
        "worst_within_bound": worst <= max(3 * idle_ttft, idle_ttft + 1.0),
        "batch_alone_s": round(alone_s, 2),
        "batch_with_chats_s": round(box["s"], 2),
        "batch_growth_s": round(box["s"] - alone_s, 2),
        "chats_idle_e2e_sum_s": round(sum(e2e for _, e2e in idle), 2),
        "batch_outputs_identical": outputs(sessions, box["id"]) == outputs(sessions, alone_id),
        "server_timings_during": _interactive_timings(sessions)[-len(during) :],
    }


def _running(sessions) -> int:
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(Job).where(Job.status == JobStatus.RUNNING)
        ).scalar_one()


def _tenant_samples(sessions, a: uuid.UUID, b: uuid.UUID, total: int) -> list[tuple[int, int]]:
    """(a's finished lines, b's), sampled every 0.25 s until either batch ends; then waits for both."""
    samples = []
    while True:
        done_a, done_b = (count(sessions, batch, [JobStatus.SUCCEEDED]) for batch in (a, b))
        if done_a == total or done_b == total:
            break
        samples.append((done_a, done_b))
        time.sleep(0.25)
    wait_done(sessions, a, total)
    wait_done(sessions, b, total)
    return samples


def _ratio_range(samples: list[tuple[int, int]], after: int) -> dict | None:
    ratios = [done_b / done_a for done_a, done_b in samples if done_a and done_b > after]
    return {"min": round(min(ratios), 3), "max": round(max(ratios), 3), "samples": len(ratios)} if ratios else None


def _interactive_timings(sessions) -> list[dict]:
    """Server-side timings of the interactive jobs, oldest first: arrival -> admitted, -> first token."""
    with sessions() as session:
        jobs = (
            session.execute(select(Job).where(Job.work_class == WorkClass.INTERACTIVE).order_by(Job.created_at))
            .scalars()
            .all()
        )
    return [
        {"queue_ms": round((job.queue_s or 0) * 1000, 1), "ttft_ms": round((job.ttft_s or 0) * 1000, 1)} for job in jobs
    ]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
