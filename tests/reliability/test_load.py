"""A bounded load test on loopback: N concurrent streaming clients for T seconds plus a batch of
jobs, against the real API and worker processes (an asyncio httpx client, no extra services).

Reports requests/s, errors (must be 0; 429s would be counted apart, as intentional back-pressure),
p99 time to first token as the client sees it (queueing included), and the resident memory of the
API and worker processes before and after (growth must stay under the stated bounds).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

NUM_CLIENTS = 8
DURATION_S = 25.0
NUM_BATCH_JOBS = 24
MAX_TOKENS = 16
# Memory bounds, after a warm-up round (first-touch allocations are not growth): a leak of even a
# few KiB per request would pass these only on a much shorter run than this one.
API_RSS_GROWTH_MIB = 64
WORKER_RSS_GROWTH_MIB = 128


@dataclass
class Stats:
    ttfts: list[float] = field(default_factory=list)
    completed: int = 0
    throttled: int = 0
    errors: list[str] = field(default_factory=list)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def body(model: str, i: int) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"load test {i}"}]}
    return "/v1/completions", {**common, "prompt": f"load test number {i}"}


async def stream_once(client: httpx.AsyncClient, path: str, payload: dict, stats: Stats) -> None:
    started, ttft, done = time.monotonic(), None, False
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code == 429:
                stats.throttled += 1
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                return
            if response.status_code != 200:
                stats.errors.append(f"{path}: {response.status_code} {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.monotonic() - started
                done = done or line == "data: [DONE]"
    except httpx.HTTPError as exc:
        stats.errors.append(f"{path}: {type(exc).__name__}: {exc}")
        return
    if not done or ttft is None:
        stats.errors.append(f"{path}: stream ended without tokens or [DONE]")
        return
    stats.ttfts.append(ttft)
    stats.completed += 1


async def client_loop(base_url: str, key: str, model: str, worker_index: int, deadline: float, stats: Stats) -> None:
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        i = worker_index
        while time.monotonic() < deadline:
            await stream_once(client, *body(model, i), stats)
            i += NUM_CLIENTS


async def run_load(base_url: str, key: str, model: str, duration_s: float) -> tuple[Stats, float]:
    stats = Stats()
    started = time.monotonic()
    await asyncio.gather(
        *(client_loop(base_url, key, model, i, started + duration_s, stats) for i in range(NUM_CLIENTS))
    )
    return stats, time.monotonic() - started


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def test_streaming_load_with_a_batch_of_jobs(api_stack):
    key, model = api_stack.keys["lab-b"], api_stack.model
    api_pid, worker_pid = api_stack.api.process.pid, api_stack.worker.process.pid
    warm, _ = asyncio.run(run_load(api_stack.api.base_url, key, model, 3.0))  # first-touch allocations
    assert not warm.errors, warm.errors[:5]
    rss_before = rss_mib(api_pid), rss_mib(worker_pid)

    with api_stack.client(key) as client:
        jobs = [
            {"prompt": f"batch job {i}", "max_tokens": 32, "temperature": 0.0, "custom_id": f"load-{i}"}
            for i in range(NUM_BATCH_JOBS)
        ]
        created = client.post("/v1/jobs", json=jobs)
        assert created.status_code == 202, created.text
        stats, elapsed = asyncio.run(run_load(api_stack.api.base_url, key, model, DURATION_S))
        deadline = time.monotonic() + 60
        while True:
            statuses = [client.get(f"/v1/jobs/{i}").json()["status"] for i in created.json()["ids"]]
            if all(s in ("succeeded", "failed", "cancelled") for s in statuses):
                break
            assert time.monotonic() < deadline, statuses
            time.sleep(0.5)
    rss_after = rss_mib(api_pid), rss_mib(worker_pid)

    rate = stats.completed / elapsed
    print(
        f"\nLOAD|{NUM_CLIENTS} streaming clients x {elapsed:.0f}s + {NUM_BATCH_JOBS} jobs|"
        f"{stats.completed} streams|{rate:.2f} req/s|errors {len(stats.errors)}|429s {stats.throttled}|"
        f"p50 TTFT {sorted(stats.ttfts)[len(stats.ttfts) // 2]:.3f}s|p99 TTFT {p99(stats.ttfts):.3f}s|"
        f"API RSS {rss_before[0]:.0f}->{rss_after[0]:.0f} MiB|worker RSS {rss_before[1]:.0f}->{rss_after[1]:.0f} MiB",
        flush=True,
    )
    assert not stats.errors, stats.errors[:5]
    assert stats.completed >= NUM_CLIENTS  # every client got at least one full stream
    assert statuses == ["succeeded"] * NUM_BATCH_JOBS
    assert rss_after[0] - rss_before[0] < API_RSS_GROWTH_MIB, (rss_before, rss_after)
    assert rss_after[1] - rss_before[1] < WORKER_RSS_GROWTH_MIB, (rss_before, rss_after)
