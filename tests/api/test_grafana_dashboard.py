"""The provisioned Grafana dashboard (monitoring/grafana) against the metrics a real run exposes:
every panel's query parses in a real Prometheus, names only metrics that the scraped stack has,
and returns series once the stack has run a job and relayed a stream; the provisioning files
point Grafana at the same datasource the panels use."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.api.compose_stack import LocalComposeStack, wait_for
from tests.api.prometheus_server import PrometheusServer
from tests.services import REPO_ROOT

GRAFANA = REPO_ROOT / "monitoring" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "tokenloom.json").read_text())
DEADLINE_S = 120  # a bound for a broken stack, not a measure of speed
# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".+"}
METRIC_NAME = re.compile(r"\btokenloom_[a-z0-9_]+\b")


def panel_queries() -> list[tuple[str, str]]:
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in DASHBOARD["panels"]
        for target in panel["targets"]
    ]


def as_prometheus_sees_it(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


@pytest.fixture(scope="module")
def busy_stack(compose_stack) -> LocalComposeStack:
    """The stack after a job and a streamed completion (the relay's ITL histogram exists only then)."""
    body = {"prompt": "dashboard", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with compose_stack.client() as client:
        job_id = client.post("/v1/jobs", json=body).json()["ids"][0]
        wait_for(
            lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded",
            DEADLINE_S,
            "the job to succeed",
            log=compose_stack.worker.log,
        )
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200 and sum(1 for _ in response.iter_lines()) > 0
    return compose_stack


def test_the_dashboard_has_the_panels_the_operators_need():
    titles = " | ".join(panel["title"] for panel in DASHBOARD["panels"]).lower()
    for topic in (
        "ttft",
        "tpot",
        "itl",
        "queue time",
        "jobs by status",
        "queue depth",
        "running / waiting",
        "kv cache",
        "prefix cache hit rate",
        "preemptions",
        "output tokens per second",
        "per class",
    ):
        assert topic in titles, topic
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)) and DASHBOARD["uid"] == "tokenloom"


def test_grafana_provisioning_loads_this_dashboard_from_the_prometheus_datasource():
    [datasource] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    uses = {
        json.dumps(t.get("datasource", panel["datasource"]), sort_keys=True)
        for panel in DASHBOARD["panels"]
        for t in panel["targets"]
    }
    assert uses == {json.dumps({"type": "prometheus", "uid": datasource["uid"]}, sort_keys=True)}
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tokenloom.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"  # where docker-compose.yml mounts them


def test_every_panel_query_parses_and_names_metrics_the_stack_exposes(prometheus, busy_stack):
    queries = panel_queries() + [
        ("variable model_name", v["query"]["query"].removeprefix("label_values(").split(",")[0])
        for v in DASHBOARD["templating"]["list"]
    ]
    named = {name for _, expr in queries for name in METRIC_NAME.findall(expr)}
    assert named, "no tokenloom metric named by any panel"

    def missing() -> set[str]:
        return named - prometheus.metric_names()

    wait_for(
        lambda: not missing(),
        DEADLINE_S,
        "every metric the dashboard names to be scraped",
        log=lambda: f"missing: {sorted(missing())}",
    )
    for title, expr in queries:
        answer = prometheus.query(as_prometheus_sees_it(expr))
        assert answer["status"] == "success", (title, expr, answer.get("error"))


def test_every_panel_query_returns_series_from_the_running_stack(prometheus, busy_stack):
    def empty() -> list[str]:
        return [
            title
            for title, expr in panel_queries()
            if not prometheus.query(as_prometheus_sees_it(expr))["data"]["result"]
        ]

    # rate() needs two scrapes after a series appears; 1 s apart here.
    wait_for(
        lambda: not empty(),
        DEADLINE_S,
        "every panel to return series",
        poll_s=1.0,
        log=lambda: f"empty panels: {empty()}",
    )
