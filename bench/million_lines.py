"""One batch of a million lines through the real stack: upload, create, run, status polls, output file.

    python -m bench.million_lines [--lines 1000000] [--workers 3] [--max-tokens 4]

A fresh Postgres database and Redis db, `tokenloom serve` and --workers `tokenloom worker`
processes (subprocesses), the trained stories260K model (../shared/models/stories260K), greedy,
--max-tokens a line (a labelling batch: a few tokens a line). The file is streamed to
POST /v1/files, the batch created, and GET /v1/batches/{id} polled every second until it ends.
Reported:

- upload and create wall times (rows inserted per second);
- throughput per window of 10,000 finished lines, from the polls: the first window's and the
  last's, and their ratio (the goal: within 10%);
- the time one status poll takes, at the start and at the end;
- peak RSS (VmHWM) of the API and of each worker, sampled at the start and the end (flat means the
  same order);
- the output file: every line once, in line order (checked while it streams).

Not a test: tests/api/test_large_batch.py runs the same path at 20,000 lines. Results go to
bench/results/million_lines.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import redis

from bench.batch_upload import peak_rss_mb
from bench.queue import ADMIN_PG_URL, fresh_database, start_worker, worker_env
from bench.serving import start_api
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.database import make_session_factory, make_sql_engine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STORIES_260K = ROOT.parent / "shared" / "models" / "stories260K"
WINDOW = 10_000


def write_file(path: Path, lines: int, max_tokens: int) -> int:
    with open(path, "w", encoding="utf-8") as out:
        for i in range(lines):
            body = {"prompt": f"Once upon a time, story {i}", "max_tokens": max_tokens, "ignore_eos": True}
            out.write(json.dumps({"custom_id": f"{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            out.write("\n")
    return path.stat().st_size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/7", help="Redis URL (its db is flushed)")
    parser.add_argument("--port", type=int, default=8767)
    args = parser.parse_args(argv)

    database_url = fresh_database(ADMIN_PG_URL, "tokenloom_bench_million")
    redis.Redis.from_url(args.broker_url).flushdb()
    key, _ = create_key(make_session_factory(make_sql_engine(database_url)), "corpus")
    env = {
        **worker_env(
            STORIES_260K,
            "float32",
            database_url,
            args.broker_url,
            {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
            256,
        ),
        "TOKENLOOM_QUEUE_GROUP_SIZE": "64",
        "TOKENLOOM_SERVER_MAX_BATCH_LINES": str(args.lines),
        "TOKENLOOM_SERVER_MAX_QUEUED_BATCH_LINES": str(args.lines),
        "TOKENLOOM_SERVER_MAX_FILE_MB": "1024",
    }
    RESULTS.mkdir(exist_ok=True)
    workers = [start_worker(env, 8, RESULTS / f"million-worker-{i}.log") for i in range(args.workers)]
    api = start_api(env, args.port, RESULTS / "million-api.log")
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{args.port}/v1", headers={"Authorization": f"Bearer {key}"}, timeout=3600
    )
    result: dict = {"lines": args.lines, "workers": args.workers, "max_tokens": args.max_tokens}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "corpus.jsonl"
            result["file_mb"] = round(write_file(path, args.lines, args.max_tokens) / 2**20, 1)
            started = time.perf_counter()
            with open(path, "rb") as body:
                upload = client.post("/files", files={"file": ("corpus.jsonl", body)}, data={"purpose": "batch"})
            upload.raise_for_status()
            result["upload_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        created = client.post(
            "/batches",
            json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
        )
        created.raise_for_status()
        result["create_s"] = round(time.perf_counter() - started, 1)
        result["rows_inserted_per_s"] = round(args.lines / result["create_s"])
        batch_id = created.json()["id"]
        rss_start = _rss(api, workers)
        samples, polls = _poll(client, batch_id)
        rss_end = _rss(api, workers)
        result.update(_throughput(samples, args.lines))
        result["status_poll_ms"] = {"first": round(polls[0] * 1000, 1), "last": round(polls[-1] * 1000, 1)}
        result["peak_rss_mb"] = {"start": rss_start, "end": rss_end}
        result["output_file"] = _check_output(client, batch_id, args.lines)
    finally:
        api.terminate()
        for worker in workers:
            worker.terminate()
        api.wait(60)
        for worker in workers:
            worker.wait(120)
    (RESULTS / "million_lines.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _rss(api, workers) -> dict:
    return {"api": round(peak_rss_mb(api.pid)), "workers": [round(peak_rss_mb(w.pid)) for w in workers]}


def _poll(client: httpx.Client, batch_id: str) -> tuple[list[tuple[float, int]], list[float]]:
    """(seconds since the first poll, lines finished) every second until the batch ends; each poll's time."""
    samples, polls = [], []
    first = time.perf_counter()
    while True:
        started = time.perf_counter()
        batch = client.get(f"/batches/{batch_id}").json()
        polls.append(time.perf_counter() - started)
        counts = batch["request_counts"]
        samples.append((started - first, counts["completed"] + counts["failed"]))
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            if batch["status"] != "completed":
                raise SystemExit(f"batch ended {batch['status']}: {batch}")
            return samples, polls
        time.sleep(1.0)


def _throughput(samples: list[tuple[float, int]], total: int) -> dict:
    """Lines per second over the first WINDOW finished lines and over the last WINDOW."""

    def time_at(done: int) -> float:
        return next(t for t, n in samples if n >= done)

    first = WINDOW / max(1e-9, time_at(WINDOW) - time_at(1))
    last = WINDOW / max(1e-9, time_at(total) - time_at(total - WINDOW))
    return {
        "run_s": round(samples[-1][0], 1),
        "lines_per_s_first_10k": round(first, 1),
        "lines_per_s_last_10k": round(last, 1),
        "last_over_first": round(last / first, 3),
        "lines_per_s_overall": round(total / samples[-1][0], 1),
    }


def _check_output(client: httpx.Client, batch_id: str, total: int) -> dict:
    batch = client.get(f"/batches/{batch_id}").json()
    expected = 0
    started = time.perf_counter()
    with client.stream("GET", f"/files/{batch['output_file_id']}/content") as response:
        for line in response.iter_lines():
            if not line:
                continue
            custom_id = json.loads(line)["custom_id"]
            if custom_id != str(expected):
                raise SystemExit(f"output line {expected} is custom_id {custom_id}: not in line order")
            expected += 1
    if expected != total:
        raise SystemExit(f"output file holds {expected} lines, not {total}")
    return {"lines": expected, "in_line_order": True, "download_s": round(time.perf_counter() - started, 1)}


if __name__ == "__main__":
    main()
