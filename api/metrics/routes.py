"""GET /metrics (Prometheus text format) and GET /v1/stats (latency percentiles and throughput).

/metrics needs no key, like /healthz: Prometheus scrapes it, and it exposes aggregates only
(counts, timings, model and worker names; no ids, prompts, outputs or project names). /v1/stats
needs a key and counts only the caller's project (every project for the admin).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from tokenloom.api.deps import Caller, State
from tokenloom.api.metrics import prometheus_exposition
from tokenloom.api.metrics.stats_schemas import ModelStats, Stats
from tokenloom.store.jobs.job_stats import window_timings
from tokenloom.store.models import utcnow

router = APIRouter(tags=["metrics"])

MAX_WINDOW_S = 30 * 24 * 3600


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def prometheus_metrics(state: State) -> Response:
    """Prometheus text exposition: queue depth, jobs by status, latency histograms, tokens, engine figures."""
    return Response(await prometheus_exposition.render(state), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/stats", response_model=Stats)
async def stats(
    state: State,
    caller: Caller,
    window_s: Annotated[float, Query(ge=1, le=MAX_WINDOW_S)] = 300.0,
    model: Annotated[str | None, Query(max_length=256)] = None,
) -> Stats:
    """p50/p90/p99 TTFT, TPOT and queue time, and output tokens/s, per model, over the jobs that
    ended in the last `window_s` seconds."""
    now = utcnow()
    found = await run_in_threadpool(
        window_timings,
        state.sessions,
        window_s,
        model=model,
        project=None if caller.is_admin else caller.project,
        now=now,
    )
    return Stats(
        window_s=window_s,
        since=int(now.timestamp() - window_s),
        data=[ModelStats.of(name, timings, window_s) for name, timings in sorted(found.items())],
    )
