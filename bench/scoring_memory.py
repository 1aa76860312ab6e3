"""What a scoring request's prompt logprobs cost in memory, per entry, in a real API and a real worker.

An entry is one prompt token's logprob or one of its alternatives: a request with prompt_logprobs k
and n choices makes prompt tokens x (k + 1) x n of them (openai_protocol/scoring_limit.py), and
`[server] max_prompt_logprob_entries` caps them; this measures what that cap bounds. Each case
runs on a fresh `tokenloom serve` + `tokenloom worker` pair (peak RSS only grows, so one case per
pair) on a fresh Postgres database, with the tiny random Llama of the tests and a 64k context:
after two small warm-up requests it sends one non-streamed `/v1/completions` request with
`max_tokens: 0`, and reads each process's peak RSS (VmHWM; the worker's largest process) before
and after. A baseline case prefills the same prompt without scoring, so the worker's figure is
what scoring adds to what the prefill needs anyway (attention over a long context costs more than
its logprobs). Not a speed figure: the numbers are bytes.

    python -m bench.scoring_memory                         # the cases of docs/api.md#scoring
    python -m bench.scoring_memory --cases 16000:20:1:none 16000:20:1:plain
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.queue import ADMIN_PG_URL, fresh_database, start_worker
from bench.serving import start_api
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

RESULTS = Path(__file__).parent / "results"
CONTEXT = 65536
TEXT = "The cat sat on the mat, and then it slept. "
# prompt tokens : k : n : none (the baseline: prefilled, not scored) | plain (prompt_logprobs) | echo (logprobs)
DEFAULT_CASES = ["60000:0:1:none", "60000:0:1:plain", "16000:20:1:none", "16000:20:1:plain", "16000:20:1:echo"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def process_tree(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def measure(checkpoint: Path, case: str, workdir: Path) -> dict:
    tokens, k, n, mode = case.split(":")
    num_tokens, k, n = int(tokens), int(k), int(n)
    model = workdir / f"scoring-{uuid.uuid4().hex[:6]}"  # its own name: its own queue
    model.symlink_to(checkpoint)
    db_url = fresh_database(ADMIN_PG_URL, f"tokenloom_bench_scoring_{uuid.uuid4().hex[:8]}")
    env = {
        **os.environ,
        "TOKENLOOM_MODEL_NAME": str(model),
        "TOKENLOOM_MODEL_DTYPE": "float32",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(CONTEXT),
        "TOKENLOOM_DATABASE_URL": db_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": "2",
        "TOKENLOOM_SERVER_MAX_BODY_MB": "64",
        "TOKENLOOM_SERVER_MAX_PROMPT_LOGPROB_ENTRIES": str(10**9),
        "TOKENLOOM_API_KEY": "bench-admin",
    }
    worker = start_worker(env, 2, workdir / f"{model.name}-worker.log")
    port = free_port()
    api = start_api(env, port, workdir / f"{model.name}-api.log")
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": "Bearer bench-admin"}, timeout=3600
        ) as client:

            def ask(size: int, scoring: str) -> int:
                text = TEXT * (size // 10 + 1)
                ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"][:size]
                body: dict = {"model": str(model), "prompt": ids, "max_tokens": 0, "n": n}
                if scoring == "plain":
                    body["prompt_logprobs"] = k
                elif scoring == "echo":
                    body.update(echo=True, logprobs=k)
                else:
                    body = {"model": str(model), "prompt": ids, "max_tokens": 1}
                reply = client.post("/v1/completions", json=body)
                if reply.status_code != 200:
                    raise SystemExit(f"{case}: {reply.status_code} {reply.text[:500]}")
                return len(reply.content)

            ask(200, mode)
            ask(200, mode)
            workers = process_tree(worker.pid)
            before = {"api": peak_rss(api.pid), "worker": max(map(peak_rss, workers))}
            started = time.perf_counter()
            body_bytes = ask(num_tokens, mode)
            seconds = time.perf_counter() - started
            after = {"api": peak_rss(api.pid), "worker": max(map(peak_rss, workers))}
    finally:
        api.terminate()
        api.wait(30)
        worker.terminate()
        worker.wait(60)
        model.unlink()
    return {
        "case": case,
        "entries": 0 if mode == "none" else num_tokens * (k + 1) * n,
        "body_bytes": body_bytes,
        "seconds": round(seconds, 1),
        "api_peak": after["api"],
        "worker_peak": after["worker"],
        "api_growth": after["api"] - before["api"],
        "worker_growth": after["worker"] - before["worker"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="tokens:k:n:none|plain|echo")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tokenloom-scoring-memory-"))
    checkpoint = build_random_checkpoint(
        workdir / "llama-64k", seed=0, max_position_embeddings=CONTEXT, initializer_range=0.1
    )
    rows = [measure(checkpoint, case, workdir) for case in args.cases]
    baselines = {r["case"].split(":")[0]: r for r in rows if r["entries"] == 0}  # by prompt tokens
    print("| case (tokens:k:n:mode) | entries | API peak, MiB | worker peak, MiB | API per entry | worker per entry |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        base = baselines.get(row["case"].split(":")[0])
        per_api = per_worker = "-"
        if row["entries"] and base is not None:
            per_api = f"{(row['api_peak'] - base['api_peak']) / row['entries']:.0f} B"
            per_worker = f"{(row['worker_peak'] - base['worker_peak']) / row['entries']:.0f} B"
        print(
            f"| {row['case']} | {row['entries']:,} | {row['api_peak'] / 2**20:.0f} | "
            f"{row['worker_peak'] / 2**20:.0f} | {per_api} | {per_worker} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"scoring_memory_{int(time.time())}.json"
    out.write_text(json.dumps(rows, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
