"""GET /metrics's body: the Prometheus exposition, built on each scrape with prometheus_client.

The API process observes almost nothing itself (workers run the jobs), so every figure is read
at scrape time from where it lives, into a fresh registry of metric families:
- job rows (Postgres): jobs by status, TTFT/TPOT/queue-time/end-to-end histograms, token totals,
  read from aggregates the database keeps (store/jobs/job_stats.py), so a scrape costs the same with a
  million jobs as with ten; these are cluster-wide totals, so every API replica reports the same
  values (scrape one replica, or aggregate with max() rather than sum());
- Redis: each model's queue length, and each live worker's engine snapshot
  (store/engine_stats.py, refreshed on the worker's heartbeat, gone when it stops);
- this process: the ITL of the token streams it relayed (api/metrics/stream_itl.py).
Each metric's meaning is in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from starlette.concurrency import run_in_threadpool

from tokenloom.api.metrics.stream_itl import STREAM_ITL
from tokenloom.api.state import ApiState
from tokenloom.store.celery_app import class_queue_keys
from tokenloom.store.engine_stats import ENGINE_STATS_PREFIX
from tokenloom.store.jobs import job_stats
from tokenloom.store.jobs.job_stats import E2E_BUCKETS, QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

# Names and labels mirror vLLM's where the meaning is the same (vLLM's `vllm:` prefix becomes
# `tokenloom_`: a colon is reserved for recording rules), so vLLM dashboards and alerts port over
# by renaming the prefix. docs/metrics.md is the table of every metric.
MODEL_LABEL = "model_name"
CLASS_LABEL = "work_class"  # interactive | jobs | batch (store/jobs/work_class.py)
HISTOGRAMS = (  # (metric, job column, buckets, help)
    (
        "tokenloom_time_to_first_token_seconds",
        "ttft_s",
        TTFT_BUCKETS,
        "Time to first token per job: first token - arrival",
    ),
    (
        "tokenloom_time_per_output_token_seconds",
        "tpot_s",
        TPOT_BUCKETS,
        "Time per output token per job: (last token - first token) / (output tokens - 1)",
    ),
    (
        "tokenloom_request_queue_time_seconds",
        "queue_s",
        QUEUE_BUCKETS,
        "Queue wait per job: admitted to the engine - arrival",
    ),
    ("tokenloom_e2e_request_latency_seconds", "e2e_s", E2E_BUCKETS, "End-to-end latency per job: finished - arrival"),
)
# The relay's ITL histogram (api/metrics/stream_itl.py) is exposed under vLLM's name and label.
ITL_METRIC = "tokenloom_inter_token_latency_seconds"

ENGINE_GAUGES = (  # (snapshot field, metric, help)
    ("running_seqs", "tokenloom_num_requests_running", "Sequences in the engine's running batch"),
    ("waiting_seqs", "tokenloom_num_requests_waiting", "Sequences waiting for KV space or a batch slot"),
    ("kv_blocks_used", "tokenloom_engine_kv_blocks_used", "KV cache blocks held by sequences"),
    ("kv_blocks_total", "tokenloom_engine_kv_blocks_total", "KV cache blocks in the pool"),
    ("max_batch_seqs", "tokenloom_engine_max_batch_size", "Largest batch (sequences) of one step so far"),
)
ENGINE_COUNTERS = (
    ("steps", "tokenloom_engine_steps", "Engine steps (one forward pass each)"),
    ("scheduled_seqs", "tokenloom_engine_scheduled_seqs", "Sequences scheduled, summed over steps"),
    ("prefill_tokens", "tokenloom_engine_prefill_tokens", "Prompt (or recomputed) tokens computed"),
    ("decode_tokens", "tokenloom_engine_decode_tokens", "Decode tokens computed"),
    ("generated_tokens", "tokenloom_engine_generation_tokens", "Output tokens sampled by the engine"),
    ("finished_requests", "tokenloom_engine_finished_requests", "Requests the engine finished"),
    ("preemptions", "tokenloom_num_preemptions", "Sequences preempted for lack of KV space"),
    ("swap_outs", "tokenloom_engine_swap_outs", "Preempted sequences whose KV was swapped to host memory"),
    ("prefix_cache_query_tokens", "tokenloom_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    (
        "prefix_cache_hit_tokens",
        "tokenloom_prefix_cache_hits",
        "Prompt tokens served from the prefix cache (not recomputed)",
    ),
)


@dataclass(slots=True)
class Figures:
    jobs: dict[tuple[str, str], int]
    tokens: dict[str, tuple[int, int]]
    histograms: dict[str, dict[str, job_stats.Histogram]]
    queues: dict[tuple[str, str], int]
    engines: list[dict[str, str]]


async def render(state: ApiState) -> bytes:
    return generate_latest(_registry(await collect(state)))


async def collect(state: ApiState) -> Figures:
    jobs, tokens, hists, engines = await asyncio.gather(
        run_in_threadpool(job_stats.jobs_by_status, state.sessions),
        run_in_threadpool(job_stats.token_totals, state.sessions),
        run_in_threadpool(_histograms, state),
        _engine_snapshots(state),
    )
    models = ({state.served.name} | {model for model, _ in jobs} | {e.get("model", "") for e in engines}) - {""}
    return Figures(jobs, tokens, hists, await _queue_depths(state, sorted(models)), engines)


def _histograms(state: ApiState) -> dict[str, dict[str, job_stats.Histogram]]:
    return {column: job_stats.histograms(state.sessions, column) for _, column, _, _ in HISTOGRAMS}


async def _queue_depths(state: ApiState, models: list[str]) -> dict[tuple[str, str], int]:
    """(model, work class) -> messages waiting (a batch message holds up to [queue] group_size lines)."""
    keys = [
        (model, work_class.value, key)
        for model in models
        for work_class, class_keys in class_queue_keys(model).items()
        for key in class_keys
    ]
    pipe = state.redis.pipeline(transaction=False)
    for _, _, key in keys:
        pipe.llen(key)
    depths: dict[tuple[str, str], int] = {}
    for (model, work_class, _), length in zip(keys, await pipe.execute()):
        depths[model, work_class] = depths.get((model, work_class), 0) + length
    return depths


async def _engine_snapshots(state: ApiState) -> list[dict[str, str]]:
    keys = [key async for key in state.redis.scan_iter(match=ENGINE_STATS_PREFIX + "*", count=100)]
    if not keys:
        return []
    pipe = state.redis.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    snapshots = []
    for key, fields in zip(keys, await pipe.execute()):
        if fields:  # expired between SCAN and HGETALL
            snapshot = {k.decode(): v.decode() for k, v in fields.items()}
            snapshot["worker"] = key.decode().removeprefix(ENGINE_STATS_PREFIX)
            snapshots.append(snapshot)
    return snapshots


def _registry(figures: Figures) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    families = list(_job_families(figures)) + list(_engine_families(figures.engines))

    class Snapshot:  # a collector that yields the families computed for this scrape
        def collect(self):
            return families

    class RelayedItl:  # observed by this process as it relays token streams
        def collect(self):
            return [_renamed(family, ITL_METRIC, {"model": MODEL_LABEL}) for family in STREAM_ITL.collect()]

    registry.register(Snapshot())
    registry.register(RelayedItl())
    return registry


def _renamed(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """`family` under another name, its labels renamed by `labels` (old -> new), without the
    `_created` timestamps (the other families have none; in the text format they would be a
    gauge of their own)."""
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue
        renamed.add_sample(
            name + sample.name.removeprefix(family.name),
            {labels.get(k, k): v for k, v in sample.labels.items()},
            sample.value,
            sample.timestamp,
            sample.exemplar,
        )
    return renamed


def _job_families(figures: Figures):
    queue = GaugeMetricFamily(
        "tokenloom_queue_depth",
        "Job messages waiting in the model's Redis queues (not yet taken by a worker), per class of work",
        labels=[MODEL_LABEL, CLASS_LABEL],
    )
    for (model, work_class), depth in figures.queues.items():
        queue.add_metric([model, work_class], depth)
    yield queue
    jobs = GaugeMetricFamily("tokenloom_jobs", "Jobs by status (rows in the database)", labels=[MODEL_LABEL, "status"])
    for (model, status), count in sorted(figures.jobs.items()):
        jobs.add_metric([model, status], count)
    yield jobs
    generated = CounterMetricFamily(
        "tokenloom_generation_tokens", "Output tokens of all jobs (rows in the database)", labels=[MODEL_LABEL]
    )
    prompt = CounterMetricFamily(
        "tokenloom_prompt_tokens", "Prompt tokens of all jobs (rows in the database)", labels=[MODEL_LABEL]
    )
    for model, (prompt_tokens, completion_tokens) in sorted(figures.tokens.items()):
        generated.add_metric([model], completion_tokens)
        prompt.add_metric([model], prompt_tokens)
    yield generated
    yield prompt
    for name, column, bounds, doc in HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=[MODEL_LABEL, CLASS_LABEL])
        for (model, work_class), hist in sorted(figures.histograms[column].items()):
            buckets = [(_le(b), n) for b, n in zip(bounds, hist.buckets)] + [("+Inf", hist.count)]
            family.add_metric([model, work_class], buckets, hist.total)
        yield family


def _engine_families(engines: list[dict[str, str]]):
    labels = ["worker", MODEL_LABEL]
    gauges = {field: GaugeMetricFamily(name, doc, labels=labels) for field, name, doc in ENGINE_GAUGES}
    counters = {field: CounterMetricFamily(name, doc, labels=labels) for field, name, doc in ENGINE_COUNTERS}
    usage = GaugeMetricFamily(
        "tokenloom_kv_cache_usage_perc", "Fraction of the KV pool held by sequences (0-1, as vLLM's)", labels=labels
    )
    age = GaugeMetricFamily(
        "tokenloom_engine_stats_age_seconds",
        "Seconds since the worker published these figures (its heartbeat)",
        labels=labels,
    )
    for snapshot in engines:
        values = [snapshot["worker"], snapshot.get("model", "")]
        for field, family in (*gauges.items(), *counters.items()):
            if field in snapshot:
                family.add_metric(values, float(snapshot[field]))
        total = float(snapshot.get("kv_blocks_total") or 0)
        if total:
            usage.add_metric(values, float(snapshot.get("kv_blocks_used") or 0) / total)
        if "updated_at" in snapshot:
            age.add_metric(values, max(0.0, time.time() - float(snapshot["updated_at"])))
    yield from gauges.values()
    yield from counters.values()
    yield usage
    yield age


def _le(bound: float) -> str:
    return repr(float(bound))
