"""A real Prometheus, configured by monitoring/prometheus.yml, scrapes a real `tokenloom serve`
and worker (docker-compose.yml's services as local processes) and answers queries for their
figures: the TTFT histogram of the jobs, and each worker's engine figures under `worker`."""

from __future__ import annotations

import pytest

from tests.api.compose_stack import LocalComposeStack, wait_for
from tests.api.prometheus_server import PrometheusServer

DEADLINE_S = 120  # a bound for a broken scrape, not a measure of speed


def series(prometheus: PrometheusServer, expr: str) -> list[dict]:
    answer = prometheus.query(expr)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_prometheus_scrapes_the_api_with_the_repos_config(prometheus):
    [up] = wait_for(
        lambda: series(prometheus, 'up{job="tokenloom"} == 1'),
        DEADLINE_S,
        "the tokenloom target to be up",
        log=prometheus.log,
    )
    assert up["metric"]["instance"].startswith("127.0.0.1:")


def test_a_jobs_ttft_reaches_prometheus(prometheus, compose_stack):
    with compose_stack.client() as client:
        created = client.post("/v1/jobs", json={"prompt": "scrape me", "max_tokens": 4, "temperature": 0})
        assert created.status_code == 202, created.text
        job_id = created.json()["ids"][0]
        wait_for(
            lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded",
            DEADLINE_S,
            "the job to succeed",
            log=compose_stack.worker.log,
        )
    model = compose_stack.model
    expr = f'tokenloom_time_to_first_token_seconds_count{{model_name="{model}",work_class="jobs"}} >= 1'
    [found] = wait_for(
        lambda: series(prometheus, expr), DEADLINE_S, "the TTFT series in Prometheus", log=prometheus.log
    )
    assert found["metric"]["job"] == "tokenloom" and float(found["value"][1]) >= 1
    buckets = series(
        prometheus, f'tokenloom_time_to_first_token_seconds_bucket{{model_name="{model}",work_class="jobs",le="+Inf"}}'
    )
    assert [float(b["value"][1]) for b in buckets] == [float(found["value"][1])]


def test_each_workers_engine_figures_reach_prometheus_labelled_by_worker(prometheus, compose_stack):
    expr = f'tokenloom_kv_cache_usage_perc{{model_name="{compose_stack.model}"}}'
    [usage] = wait_for(
        lambda: series(prometheus, expr), DEADLINE_S, "the worker's engine figures", log=compose_stack.worker.log
    )
    assert usage["metric"]["worker"] and 0 <= float(usage["value"][1]) <= 1
    blocks = series(prometheus, f'tokenloom_engine_kv_blocks_total{{worker="{usage["metric"]["worker"]}"}}')
    assert float(blocks[0]["value"][1]) > 0
