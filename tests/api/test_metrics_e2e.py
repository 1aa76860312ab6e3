"""GET /metrics (parsed with prometheus_client's own parser) and GET /v1/stats against the real
stack: figures must match the job rows, the Redis queue and a real engine's published counters."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import MAX_MODEL_LEN
from tests.api.test_jobs_e2e import job, wait_terminal
from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.celery_app import make_celery, queue_name, send_job
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.engine_stats import engine_stats_key, publish_engine_stats
from tokenloom.store.models import Job

BROKER = "redis://127.0.0.1:6379/0"


def scrape(stack) -> dict[str, list]:
    """metric sample name -> [(labels, value)]; /metrics needs no key."""
    with stack.client(key=None) as client:
        reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples, name: str, **labels) -> float:
    found = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {samples.get(name)}"
    return found[0]


def test_metrics_report_jobs_histograms_and_tokens_from_the_rows(stack):
    with stack.client() as client:
        ids = client.post("/v1/jobs", json=[job(f"metrics {i}") for i in range(3)]).json()["ids"]
        done = [wait_terminal(client, i) for i in ids]
    assert [d["status"] for d in done] == ["succeeded"] * 3
    samples = scrape(stack)
    model = stack.model
    assert value(samples, "tokenloom_jobs", model_name=model, status="succeeded") >= 3
    assert value(samples, "tokenloom_generation_tokens_total", model_name=model) >= 3 * 8
    for name in (
        "tokenloom_time_to_first_token_seconds",
        "tokenloom_time_per_output_token_seconds",
        "tokenloom_request_queue_time_seconds",
        "tokenloom_e2e_request_latency_seconds",
    ):
        # /v1/jobs requests: the jobs class (docs/priority.md)
        buckets = [
            (float(lbl["le"]), v)
            for lbl, v in samples[f"{name}_bucket"]
            if lbl["model_name"] == model and lbl["work_class"] == "jobs"
        ]
        counts = [v for _, v in sorted(buckets)]
        assert counts == sorted(counts)
        assert counts[-1] == value(samples, f"{name}_count", model_name=model, work_class="jobs") >= 3
        assert value(samples, f"{name}_sum", model_name=model, work_class="jobs") > 0
    assert value(samples, "tokenloom_queue_depth", model_name=model, work_class="jobs") >= 0


def test_each_finished_job_adds_its_end_to_end_latency_to_its_models_histogram(stack):
    name = "tokenloom_e2e_request_latency_seconds"

    def count_and_sum(samples) -> tuple[float, float]:
        mine = dict(model_name=stack.model, work_class="jobs")  # /v1/jobs requests (docs/priority.md)
        if not any(all(lbl.get(k) == v for k, v in mine.items()) for lbl, _ in samples.get(f"{name}_count", [])):
            return 0.0, 0.0  # no job of the model and class has finished yet
        return value(samples, f"{name}_count", **mine), value(samples, f"{name}_sum", **mine)

    count_before, sum_before = count_and_sum(scrape(stack))
    with stack.client() as client:
        ids = client.post("/v1/jobs", json=[job(f"e2e {i}") for i in range(2)]).json()["ids"]
        done = [wait_terminal(client, i) for i in ids]
    assert [d["status"] for d in done] == ["succeeded"] * 2
    count_after, sum_after = count_and_sum(scrape(stack))
    assert count_after - count_before == 2
    # The worker measures arrival -> the engine's finish: after the first token, before the row's
    # finished_at (the API's e2e_s is finished_at - created_at). Slack: timestamps keep microseconds.
    added = sum_after - sum_before
    assert sum(d["ttft_s"] for d in done) < added <= sum(d["e2e_s"] for d in done) + 1e-5


def test_streamed_responses_feed_the_inter_token_latency_histogram(stack):
    def count(samples) -> float:
        found = [
            v
            for lbl, v in samples.get("tokenloom_inter_token_latency_seconds_count", [])
            if lbl["model_name"] == stack.model
        ]
        return found[0] if found else 0.0

    before = count(scrape(stack))
    with stack.client() as client:
        body = {**job("itl"), "stream": True, "n": 2}
        with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) == 2 * 8 + 2  # a chunk per token per choice, then a finish chunk per choice
    samples = scrape(stack)
    assert count(samples) - before == 2 * 7  # a gap between each two successive tokens of each choice
    buckets = sorted(
        (float(lbl["le"]), v)
        for lbl, v in samples["tokenloom_inter_token_latency_seconds_bucket"]
        if lbl["model_name"] == stack.model
    )
    assert (
        buckets[-1][1] == count(samples)
        and value(samples, "tokenloom_inter_token_latency_seconds_sum", model_name=stack.model) >= 0
    )


def test_queue_depth_is_the_length_of_the_models_redis_queue(stack):
    """A model no worker serves: its messages stay in Redis, and /metrics counts them."""
    ghost = f"ghost-{uuid.uuid4().hex[:8]}"
    sessions = make_session_factory(make_sql_engine(stack.db_url))
    rows = [Job(id=uuid.uuid4(), project="metrics-ghost", model=ghost, prompt="x", params={}) for _ in range(3)]
    with sessions.begin() as session:
        session.add_all(rows)
    celery = make_celery(BROKER)
    try:
        for row in rows:
            send_job(celery, row.id, ghost)
        samples = scrape(stack)
        assert value(samples, "tokenloom_queue_depth", model_name=ghost, work_class="jobs") == 3
        assert value(samples, "tokenloom_jobs", model_name=ghost, status="queued") == 3
    finally:
        redis.Redis.from_url(BROKER).delete(queue_name(ghost))


@pytest.fixture(scope="module")
def busy_engine(stack) -> Engine:
    engine = Engine(engine_config(stack.checkpoint, model=dict(max_model_len=MAX_MODEL_LEN)))
    prefix = list(range(10, 60))  # a shared 50-token prefix: the second prompt hits the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt in ([1, 2], [3, 4]):
        engine.generate([prefix + prompt], params)
    return engine


def test_engine_figures_published_by_a_worker_appear_per_worker(stack, busy_engine):
    worker_id = f"test-host:{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(BROKER)
    publish_engine_stats(client, worker_id, busy_engine, ttl_s=30)
    try:
        assert 0 < client.ttl(engine_stats_key(worker_id)) <= 30
        samples = scrape(stack)
        labels = {"worker": worker_id, "model_name": busy_engine.model_name}
        counters = busy_engine.counters
        assert (
            value(samples, "tokenloom_engine_generation_tokens_total", **labels) == counters.num_generated_tokens == 10
        )
        assert value(samples, "tokenloom_engine_steps_total", **labels) == counters.num_steps
        assert value(samples, "tokenloom_num_preemptions_total", **labels) == counters.num_preemptions
        hits = value(samples, "tokenloom_prefix_cache_hits_total", **labels)
        assert hits == counters.prefix_cache_hits > 0
        assert value(samples, "tokenloom_engine_kv_blocks_total", **labels) == busy_engine.kv_manager.pool.num_blocks
        assert value(samples, "tokenloom_num_requests_running", **labels) == 0  # idle now
        assert value(samples, "tokenloom_engine_max_batch_size", **labels) == 1
        assert 0 <= value(samples, "tokenloom_kv_cache_usage_perc", **labels) <= 1
        assert 0 <= value(samples, "tokenloom_engine_stats_age_seconds", **labels) < 30
    finally:
        client.delete(engine_stats_key(worker_id))
    assert not [lbl for lbl, _ in scrape(stack).get("tokenloom_engine_steps_total", []) if lbl["worker"] == worker_id]


def test_the_stack_workers_heartbeat_publishes_its_engine_figures(stack):
    deadline = time.monotonic() + 60  # a bound for a broken heartbeat (it beats every second), not a speed
    while not (
        mine := [
            lbl
            for lbl, _ in scrape(stack).get("tokenloom_engine_kv_blocks_total", [])
            if lbl["model_name"] == stack.model and not lbl["worker"].startswith("test-host:")
        ]
    ):
        assert time.monotonic() < deadline, "no engine figures from the worker after 60 s"
        time.sleep(0.5)
    samples = scrape(stack)
    labels = {"worker": mine[0]["worker"], "model_name": stack.model}
    assert value(samples, "tokenloom_engine_kv_blocks_total", **labels) > 0
    assert value(samples, "tokenloom_engine_steps_total", **labels) > 0  # earlier tests ran jobs on it
    assert value(samples, "tokenloom_engine_stats_age_seconds", **labels) < 10


def test_stats_give_percentiles_and_throughput_of_the_callers_recent_jobs(stack):
    key, _ = create_key(make_session_factory(make_sql_engine(stack.db_url)), f"stats-{uuid.uuid4().hex[:6]}")
    with stack.client(key) as client:
        assert client.get("/v1/stats").json()["data"] == []  # a new project has no jobs
        ids = client.post("/v1/jobs", json=[job(f"stats {i}") for i in range(4)]).json()["ids"]
        done = [wait_terminal(client, i) for i in ids]
        time.sleep(0.01)
        stats = client.get("/v1/stats", params={"window_s": 600}).json()
        other_model = client.get("/v1/stats", params={"window_s": 600, "model": "nope"}).json()
        assert client.get("/v1/stats", params={"window_s": 0}).status_code == 422
    assert other_model["data"] == []
    [row] = stats["data"]
    assert (row["model"], row["succeeded"], row["failed"], row["output_tokens"]) == (stack.model, 4, 0, 32)
    assert row["throughput_tokens_per_s"] == pytest.approx(32 / 600)
    for name in ("ttft_s", "tpot_s", "queue_s"):
        values = [d[name] for d in done]
        expected = np.percentile(values, [50, 90, 99])
        got = row[name]
        assert got["samples"] == 4 and [got["p50"], got["p90"], got["p99"]] == pytest.approx(list(expected), rel=1e-6)


def test_every_exposed_metric_is_in_the_docs_table(stack):
    """docs/metrics.md is the one table of metrics: nothing /metrics exposes is missing from it."""
    from tests.services import REPO_ROOT

    with stack.client() as client:  # a streamed response: the relay's ITL histogram exists only then
        with client.stream("POST", "/v1/completions", json={**job("docs"), "stream": True}) as response:
            assert sum(1 for _ in response.iter_lines()) > 0
    table = (REPO_ROOT / "docs" / "metrics.md").read_text()
    with stack.client(key=None) as client:
        families = list(text_string_to_metric_families(client.get("/metrics").text))
    # The parser names a counter family without its _total; the table names the series.
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in families if f.name.startswith("tokenloom_")}
    assert "tokenloom_inter_token_latency_seconds" in exposed and "tokenloom_num_requests_running" in exposed
    missing = sorted(name for name in exposed if f"`{name}`" not in table)
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"
