"""The queue's cost, measured against the same work in-process, in the same run.

    python -m bench.queue [--parts short,w1,upload,table] [--database-url URL] [--broker-url URL]

- short: 3,000 short jobs (stories260K, max_tokens 4, greedy): `tokenloom submit` through
  Postgres + Redis + one `tokenloom worker` vs `tokenloom run` (in-process, whole command);
- w1 (W5 in design/BENCHMARKS.md): W1 on bench-135m as a batch through the queue vs
  `Engine.generate` in-process;
- upload: a 50,000-line batch file through the API: upload and create times, rows/s inserted,
  the API's peak RSS (bench/batch_upload.py);
- table: /metrics and /v1/jobs query latency with 10,000 vs 1,000,000 job rows
  (bench/jobs_table_scale.py).

A queue figure is the wall time from `submit_file` (rows inserted, messages sent) until every job
row is terminal, with the worker started and warmed up before the clock starts; short and w1 show
the median of --repeat runs of each path. Not a test: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis
import torch
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from bench import batch_upload, jobs_table_scale
from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.offline import run_tokenloom
from bench.workloads import w1_offline_mixed
from tokenloom.engine.runner.device import cpu_bfloat16_is_faster
from tokenloom.store import migrate
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_service import submit_file
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobStatus

ROOT = Path(__file__).resolve().parents[1]
ADMIN_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def fresh_database(admin_url: str, name: str) -> str:
    admin = create_engine(admin_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    return url


def start_worker(env: dict, concurrency: int, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.cli", "worker", "--concurrency", str(concurrency)],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while "ready" not in log_path.read_text():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"worker did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return worker


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_batch(sessions, app, lines: list[dict], model: str, workdir: Path, group_size: int) -> float:
    path = workdir / f"w5-{uuid.uuid4().hex[:6]}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    start = time.perf_counter()
    batch_id = submit_file(sessions, app, path, model, group_size=group_size).batch_id
    while True:
        with sessions() as session:
            done = session.execute(
                select(func.count())
                .select_from(Job)
                .where(Job.batch_id == batch_id, Job.status.in_(TERMINAL_JOB_STATUSES))
            ).scalar_one()
        if done == len(lines):
            break
        time.sleep(0.05)
    wall = time.perf_counter() - start
    with sessions() as session:
        failed = session.execute(
            select(func.count()).select_from(Job).where(Job.batch_id == batch_id, Job.status != JobStatus.SUCCEEDED)
        ).scalar_one()
    if failed:
        raise SystemExit(f"{failed} jobs did not succeed")
    return wall


STORIES_260K = ROOT.parent / "shared" / "models" / "stories260K"
SHORT_JOBS = 3000
SHORT_MAX_TOKENS = 4


def worker_env(checkpoint, dtype: str, database_url: str, broker_url: str, scheduler: dict, max_model_len: int) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_DTYPE": dtype,
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(max_model_len),
        "TOKENLOOM_DATABASE_URL": database_url,
        "TOKENLOOM_QUEUE_BROKER_URL": broker_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(scheduler["max_num_seqs"]),
        "TOKENLOOM_SCHEDULER_MAX_NUM_BATCHED_TOKENS": str(scheduler["max_num_batched_tokens"]),
    }


def through_queue(
    env: dict,
    database_url: str,
    broker_url: str,
    model: str,
    lines: list[dict],
    concurrency: int,
    log_name: str,
    repeat: int,
) -> tuple[float, float]:
    """(median wall s, worker CPU s per run) for `lines` as one batch through a warmed-up worker.

    Each run gets a fresh worker, as each in-process run gets a fresh engine: a second run in the
    same worker would find the prompts in its prefix cache.
    """
    redis.Redis.from_url(broker_url).flushdb()
    sessions = make_session_factory(make_sql_engine(database_url))
    app = make_celery(broker_url)
    group_size = int(env.get("TOKENLOOM_QUEUE_GROUP_SIZE", "32"))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    walls, cpu_s = [], 0.0
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(repeat):
            worker = start_worker(env, concurrency, results / log_name)  # the log is kept for inspection
            try:
                run_batch(
                    sessions, app, [dict(lines[0], prompt=[5] * 16, max_tokens=4)], model, Path(workdir), group_size
                )
                cpu_before = process_cpu_s(worker.pid)
                walls.append(run_batch(sessions, app, lines, model, Path(workdir), group_size))
                cpu_s += process_cpu_s(worker.pid) - cpu_before
            finally:
                worker.terminate()
                worker.wait(60)
    return statistics.median(walls), cpu_s / repeat


def bench_short(args, database_url: str) -> list[str]:
    """The issue's short-job file: 3,000 jobs of 4 output tokens, queue vs `tokenloom run`."""
    lines = [
        {
            "custom_id": f"s{i}",
            "prompt": f"Once upon a time, story {i} began with",
            "max_tokens": SHORT_MAX_TOKENS,
            "temperature": 0,
        }
        for i in range(SHORT_JOBS)
    ]
    scheduler = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    env = worker_env(STORIES_260K, "float32", database_url, args.broker_url, scheduler, 256)
    with tempfile.TemporaryDirectory() as workdir:
        source = Path(workdir) / "short.jsonl"
        source.write_text("".join(json.dumps(line) + "\n" for line in lines))
        walls = []
        for attempt in range(args.repeat):  # a fresh ledger each time: nothing to resume
            offline_env = {**env, "TOKENLOOM_DATABASE_URL": f"sqlite:///{workdir}/ledger-{attempt}.db"}
            start = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tokenloom.cli",
                    "run",
                    str(source),
                    "-o",
                    f"{workdir}/out-{attempt}.jsonl",
                    "--quiet",
                ],
                env=offline_env,
                cwd=ROOT,
                check=True,
            )
            walls.append(time.perf_counter() - start)
        offline_s = statistics.median(walls)
    queue_s, worker_cpu_s = through_queue(
        env, database_url, args.broker_url, str(STORIES_260K), lines, 4, "queue-short-worker.log", args.repeat
    )
    print(
        f"short jobs: tokenloom run {offline_s:.2f} s, queue {queue_s:.2f} s (worker CPU {worker_cpu_s:.1f} s)",
        flush=True,
    )
    return [
        f"| {SHORT_JOBS} short jobs (stories260K, max_tokens {SHORT_MAX_TOKENS}) | `tokenloom run` (whole command) "
        f"| {offline_s:.2f} | {SHORT_JOBS / offline_s:.0f} jobs/s | 1.00x |",
        f"| | `tokenloom submit` + 1 worker | {queue_s:.2f} | {SHORT_JOBS / queue_s:.0f} jobs/s | "
        f"{offline_s / queue_s:.2f}x |",
    ]


def bench_w1(args, database_url: str) -> list[str]:
    """W5: W1 on bench-135m through the queue vs `Engine.generate` in-process."""
    dtype = "bfloat16" if cpu_bfloat16_is_faster() else "float32"
    checkpoint = bench_135m_checkpoint(getattr(torch, dtype))
    requests = w1_offline_mixed(BENCH_135M["vocab_size"], num_requests=args.requests)
    output_tokens = sum(r.max_tokens for r in requests)
    scheduler = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    in_process_s = statistics.median(
        run_tokenloom(checkpoint, dtype, requests, {"scheduler": scheduler})[0] for _ in range(args.repeat)
    )
    env = worker_env(checkpoint, dtype, database_url, args.broker_url, scheduler, 512)
    lines = [
        {
            "custom_id": f"w1-{i}",
            "prompt": r.prompt_token_ids,
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i, r in enumerate(requests)
    ]
    queue_s, worker_cpu_s = through_queue(
        env, database_url, args.broker_url, str(checkpoint), lines, 4, "w5-worker.log", args.repeat
    )
    print(
        f"W1: in-process {in_process_s:.2f} s, queue {queue_s:.2f} s (worker CPU {worker_cpu_s:.1f} s, "
        f"{worker_cpu_s / queue_s:.2f} cores busy)",
        flush=True,
    )
    return [
        f"| W1 ({len(requests)} requests, bench-135m {dtype}) | `Engine.generate` in-process | {in_process_s:.2f} | "
        f"{output_tokens / in_process_s:.1f} tok/s | 1.00x |",
        f"| | batch through 1 worker | {queue_s:.2f} | {output_tokens / queue_s:.1f} tok/s | "
        f"{in_process_s / queue_s:.2f}x |",
    ]


def start_api(env: dict, port: int, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        api = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return api
        except httpx.HTTPError:
            pass
        if api.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"tokenloom serve did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)


def bench_upload(args, database_url: str) -> list[str]:
    """(c) a 50,000-line batch through the API, with one worker running it to completion."""
    scheduler = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    env = {
        **worker_env("", "float32", database_url, args.broker_url, scheduler, 256),  # "" = the demo model
        "TOKENLOOM_SERVER_API_BASE": "http://127.0.0.1:8765",
    }
    redis.Redis.from_url(args.broker_url).flushdb()
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    api = start_api(env, 8765, results / "queue-upload-api.log")
    worker = start_worker(env, 4, results / "queue-upload-worker.log")
    try:
        rss_before = batch_upload.peak_rss_mb(api.pid)
        start = time.perf_counter()
        figures = batch_upload.run("http://127.0.0.1:8765", None, args.batch_lines)
        rss_after = batch_upload.peak_rss_mb(api.pid)
        while True:
            batch = httpx.get(f"http://127.0.0.1:8765/v1/batches/{figures['batch_id']}", timeout=30).json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(0.5)
        done_s = time.perf_counter() - start
    finally:
        worker.terminate()
        api.terminate()
        worker.wait(60)
        api.wait(60)
    counts = batch["request_counts"]
    print(
        f"upload: {figures}; batch {batch['status']} {counts} after {done_s:.1f} s; API VmHWM "
        f"{rss_before:.0f} -> {rss_after:.0f} MiB",
        flush=True,
    )
    n = figures["num_requests"]
    return [
        f"| {n:,}-line batch file ({figures['file_mb']:.1f} MB, max_tokens 1, demo model) | upload | "
        f"{figures['upload_s']:.2f} | {figures['file_mb'] / figures['upload_s']:.0f} MB/s | API peak RSS "
        f"{rss_before:.0f} -> {rss_after:.0f} MiB |",
        f"| | create (validate + insert rows + queue) | {figures['create_s']:.2f} | "
        f"{figures['rows_per_s']:.0f} rows/s | |",
        f"| | upload to batch `{batch['status']}` ({counts['completed']:,} done, 1 worker) | {done_s:.2f} | "
        f"{n / done_s:.0f} jobs/s | |",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="short,w1,upload,table", help="comma-separated: short, w1, upload, table")
    parser.add_argument("--database-url", help=f"Postgres URL (default: a fresh database next to {ADMIN_PG_URL})")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/5", help="Redis URL (its db is flushed)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=64, help="W1 has 64; fewer for a quick check")
    parser.add_argument("--batch-lines", type=int, default=50_000, help="lines of the uploaded batch file")
    parser.add_argument("--repeat", type=int, default=3, help="runs per path for short and w1; medians are shown")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    rows: list[str] = []
    if "short" in parts:
        rows += bench_short(args, args.database_url or fresh_database(ADMIN_PG_URL, "tokenloom_bench_queue"))
    if "w1" in parts:
        rows += bench_w1(args, args.database_url or fresh_database(ADMIN_PG_URL, "tokenloom_bench_queue"))
    if "upload" in parts:
        rows += bench_upload(args, args.database_url or fresh_database(ADMIN_PG_URL, "tokenloom_bench_queue"))
    print(
        f"\nQueue vs in-process, CPU ({torch.get_num_threads()} threads); scheduler max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}\n"
    )
    print("| workload | path | wall s | rate | vs in-process |")
    print("| --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows), flush=True)
    if "table" in parts:
        print("\nJob-table reads, 10,000 vs 1,000,000 rows (median of 20 calls)\n")
        print(jobs_table_scale.format_table(jobs_table_scale.run(ADMIN_PG_URL)), flush=True)


if __name__ == "__main__":
    main()
