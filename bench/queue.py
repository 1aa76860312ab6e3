"""W5, queue overhead: W1 as a batch through Redis + Celery + Postgres vs the same engine in-process.

    python -m bench.queue [--database-url URL] [--broker-url URL]

Both paths run the same engine configuration on bench-135m, in the same run. The in-process
figure is `Engine.generate` over W1; the queue figure is the wall time from `submit_file` (rows
inserted, messages sent) until every job row is terminal, with one `tokenloom worker` process
(started and warmed up before the clock starts) pulling the jobs from Redis and writing results,
token streams and batch files. Not a test: read the ratio, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
import torch
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from bench.bench_model import BENCH_135M, bench_135m_checkpoint
from bench.offline import run_tokenloom
from bench.workloads import w1_offline_mixed
from tokenloom.engine.device import cpu_bfloat16_is_faster
from tokenloom.store import migrate
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.job_service import submit_file
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
        worker = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "worker", "--concurrency", str(concurrency)],
                                  env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
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


def run_batch(sessions, app, lines: list[dict], model: str, workdir: Path) -> float:
    path = workdir / f"w5-{uuid.uuid4().hex[:6]}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    start = time.perf_counter()
    batch_id = submit_file(sessions, app, path, model).batch_id
    while True:
        with sessions() as session:
            done = session.execute(select(func.count()).select_from(Job).where(
                Job.batch_id == batch_id, Job.status.in_(TERMINAL_JOB_STATUSES))).scalar_one()
        if done == len(lines):
            break
        time.sleep(0.05)
    wall = time.perf_counter() - start
    with sessions() as session:
        failed = session.execute(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id, Job.status != JobStatus.SUCCEEDED)).scalar_one()
    if failed:
        raise SystemExit(f"{failed} jobs did not succeed")
    return wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help=f"Postgres URL (default: a fresh database next to {ADMIN_PG_URL})")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/5", help="Redis URL (its db is flushed)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=64, help="W1 has 64; fewer for a quick check")
    args = parser.parse_args(argv)
    dtype = "bfloat16" if cpu_bfloat16_is_faster() else "float32"
    checkpoint = bench_135m_checkpoint(getattr(torch, dtype))
    requests = w1_offline_mixed(BENCH_135M["vocab_size"], num_requests=args.requests)
    output_tokens = sum(r.max_tokens for r in requests)
    scheduler = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)

    cpu_before = time.process_time()
    in_process_s, _ = run_tokenloom(checkpoint, dtype, requests, {"scheduler": scheduler})
    in_process_cpu_s = time.process_time() - cpu_before  # includes loading the engine
    print(f"in-process: {in_process_s:.1f} s, {output_tokens / in_process_s:.1f} output tok/s; process CPU "
          f"{in_process_cpu_s:.1f} s incl. load", flush=True)

    database_url = args.database_url or fresh_database(ADMIN_PG_URL, "tokenloom_bench_w5")
    redis.Redis.from_url(args.broker_url).flushdb()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENLOOM_MODEL_NAME": str(checkpoint),
           "TOKENLOOM_MODEL_DTYPE": dtype, "TOKENLOOM_MODEL_MAX_MODEL_LEN": "512",
           "TOKENLOOM_DATABASE_URL": database_url, "TOKENLOOM_QUEUE_BROKER_URL": args.broker_url,
           "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(args.max_num_seqs),
           "TOKENLOOM_SCHEDULER_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens)}
    lines = [{"custom_id": f"w1-{i}", "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens,
              "temperature": 0, "ignore_eos": True} for i, r in enumerate(requests)]
    sessions = make_session_factory(make_sql_engine(database_url))
    app = make_celery(args.broker_url)
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        worker = start_worker(env, 2 * args.max_num_seqs, results / "w5-worker.log")  # kept for inspection
        try:
            run_batch(sessions, app, [dict(lines[0], max_tokens=4)], str(checkpoint), Path(workdir))  # warm-up
            cpu_before = process_cpu_s(worker.pid)
            queue_s = run_batch(sessions, app, lines, str(checkpoint), Path(workdir))
            worker_cpu_s = process_cpu_s(worker.pid) - cpu_before
        finally:
            worker.terminate()
            worker.wait(60)
    print(f"queue: {queue_s:.1f} s, {output_tokens / queue_s:.1f} output tok/s; worker process CPU "
          f"{worker_cpu_s:.1f} s ({worker_cpu_s / queue_s:.2f} cores busy)", flush=True)

    print(f"\nW5 on bench-135m, {dtype}, CPU ({torch.get_num_threads()} threads), {len(requests)} requests, "
          f"{output_tokens} output tokens; scheduler max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}\n")
    print("| path | wall s | output tok/s | vs in-process |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| in-process Engine.generate | {in_process_s:.2f} | {output_tokens / in_process_s:.1f} | 1.00x |")
    print(f"| Redis + Celery worker + Postgres | {queue_s:.2f} | {output_tokens / queue_s:.1f} | "
          f"{in_process_s / queue_s:.2f}x |")


if __name__ == "__main__":
    main()
