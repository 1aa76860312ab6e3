"""Classes of work through the API: each endpoint's class, `service_tier` and `priority` on the row,
and the per-class figures of /metrics (real uvicorn, Postgres, Redis and worker)."""

from __future__ import annotations

import uuid

from tests.api.test_jobs_e2e import job, wait_terminal
from tokenloom.store.api_keys.key_queries import create_key


def _newest_job(client) -> dict:
    return client.get("/v1/jobs", params={"limit": 1}).json()["data"][0]


def test_each_endpoint_runs_its_class_and_the_row_shows_class_and_priority(stack, stack_sessions):
    # A key granted the priority tier and negative priorities (tests/api/test_class_allowance.py: without them).
    key, _ = create_key(stack_sessions, f"classes-{uuid.uuid4().hex[:8]}", allow_priority_tier=True, min_priority=-3)
    with stack.client(key) as client:
        created = client.post("/v1/jobs", json=job(priority=5)).json()["data"][0]
        assert (created["work_class"], created["priority"]) == ("jobs", 5)
        assert wait_terminal(client, created["id"])["status"] == "succeeded"

        tiered = client.post("/v1/jobs", json=job(service_tier="priority")).json()["data"][0]
        assert tiered["work_class"] == "interactive"
        assert wait_terminal(client, tiered["id"])["status"] == "succeeded"

        answered = client.post("/v1/completions", json=job(priority=-3))
        assert answered.status_code == 200, answered.text
        row = _newest_job(client)
        assert (row["work_class"], row["priority"], row["status"]) == ("interactive", -3, "succeeded")

        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "service_tier": "flex"},
        )
        assert chat.status_code == 200, chat.text
        assert _newest_job(client)["work_class"] == "batch"  # flex: it waits for everything else


def test_an_unknown_service_tier_or_priority_out_of_range_is_refused(stack):
    with stack.client(stack.project_keys["lab-a"]) as client:
        tier = client.post("/v1/completions", json=job(service_tier="turbo"))
        priority = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "priority": 5000}
        )
    assert tier.status_code in (400, 422) and "service_tier" in tier.text
    assert priority.status_code in (400, 422) and "priority" in priority.text


def test_metrics_break_queue_depth_and_timings_down_by_class(stack):
    with stack.client(stack.project_keys["lab-a"]) as client:
        assert client.post("/v1/completions", json=job()).status_code == 200
    with stack.client() as admin:
        text = admin.get("/metrics").text
    assert 'tokenloom_queue_depth{model_name="' in text and 'work_class="batch"' in text
    assert any(
        line.startswith("tokenloom_time_to_first_token_seconds_count{") and 'work_class="interactive"' in line
        for line in text.splitlines()
    )
