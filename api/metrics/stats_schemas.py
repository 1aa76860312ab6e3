"""GET /v1/stats figures: p50/p90/p99 of TTFT, TPOT and queue time, and output throughput, per
model, over the jobs that ended in the last `window_s` seconds (from the job rows).

Throughput is output tokens of the jobs that succeeded in the window / the window's length: the
rate the service delivered over that period, idle time included (like Prometheus' rate()).
Percentiles interpolate linearly between samples (numpy's default), so p99 of 10 samples lies
between the two largest.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from tokenloom.store.jobs.job_stats import WindowTimings

QUANTILES = (50, 90, 99)


class Percentiles(BaseModel):
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    samples: int

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        if not values:
            return cls(p50=None, p90=None, p99=None, mean=None, samples=0)
        p50, p90, p99 = (float(v) for v in np.percentile(values, QUANTILES))
        return cls(p50=p50, p90=p90, p99=p99, mean=float(np.mean(values)), samples=len(values))


class ModelStats(BaseModel):
    model: str
    succeeded: int
    failed: int
    output_tokens: int
    throughput_tokens_per_s: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    queue_s: Percentiles

    @classmethod
    def of(cls, model: str, timings: WindowTimings, window_s: float) -> "ModelStats":
        return cls(
            model=model,
            succeeded=timings.succeeded,
            failed=timings.failed,
            output_tokens=timings.output_tokens,
            throughput_tokens_per_s=timings.output_tokens / window_s,
            ttft_s=Percentiles.of(timings.ttft_s),
            tpot_s=Percentiles.of(timings.tpot_s),
            queue_s=Percentiles.of(timings.queue_s),
        )


class Stats(BaseModel):
    object: str = "stats"
    window_s: float
    since: int  # unix time of the window's start
    data: list[ModelStats]
