"""Who may use which class of work (docs/priority.md, api/class_allowance.py), through every way in,
against the real stack (uvicorn, Postgres, Redis, a worker):

- a key without the allowance cannot put work in the interactive class (`service_tier: "priority"`
  on /v1/jobs) nor set a priority below 0 (which would preempt other projects' requests of its
  class): a 403 `class_not_allowed` naming the field, the allowance and how to get it, and nothing
  is queued; on /v1/jobs, /v1/chat/completions, /v1/completions and Batch API lines (the line fails);
- a key an admin granted more can, within its grant; the admin can do anything;
- `tokenloom keys create/grant/list` set and show the allowance, and a grant applies at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.api.conftest import keys_cli
from tests.api.test_jobs_e2e import job, wait_terminal
from tokenloom.store.api_keys.key_queries import create_key, grant_key

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def fresh_key(stack_sessions) -> tuple[str, str]:
    """A key of a project of its own, with the default allowance: (key, project)."""
    project = f"tenant-{uuid.uuid4().hex[:8]}"
    return create_key(stack_sessions, project)[0], project


def _granted_key(sessions, **allowance) -> str:
    return create_key(sessions, f"granted-{uuid.uuid4().hex[:8]}", **allowance)[0]


def assert_not_allowed(response, param: str, *hints: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("class_not_allowed", param, "permission_error")
    for hint in hints:
        assert hint in error["message"], error["message"]


def _no_jobs(client) -> bool:
    return client.get("/v1/jobs").json()["data"] == []


def test_service_tier_priority_on_v1_jobs_is_refused_without_the_allowance(stack, fresh_key):
    key, _ = fresh_key
    with stack.client(key) as client:
        one = client.post("/v1/jobs", json=job(service_tier="priority"))
        # The attack: 20 jobs in one POST, each asking for the interactive class.
        many = client.post("/v1/jobs", json=[job(f"item {i}", service_tier="priority") for i in range(20)])
        mixed = client.post("/v1/jobs", json=[job("fine"), job("greedy", service_tier="priority")])
        assert _no_jobs(client)  # refused before anything was queued
        lower = client.post("/v1/jobs", json=[job(service_tier=tier) for tier in ("flex", "auto", "default")])
    assert_not_allowed(one, "service_tier", "interactive", "--allow-priority-tier", key[:12], "/v1/chat/completions")
    assert_not_allowed(many, "service_tier", "item 0: ")
    assert_not_allowed(mixed, "service_tier", "item 1: ")
    assert lower.status_code == 202, lower.text  # asking for the same or a lower class needs nothing
    assert [j["work_class"] for j in lower.json()["data"]] == ["batch", "jobs", "jobs"]


def test_a_negative_priority_on_v1_jobs_is_refused_without_the_allowance(stack, fresh_key):
    key, _ = fresh_key
    with stack.client(key) as client:
        refused = client.post("/v1/jobs", json=job(priority=-1))
        assert _no_jobs(client)
        own_order = client.post("/v1/jobs", json=[job(priority=0), job(priority=1000)])
    assert_not_allowed(refused, "priority", "priority >= 0", "preempt", "--min-priority -1", key[:12])
    assert own_order.status_code == 202, own_order.text
    assert [(j["work_class"], j["priority"]) for j in own_order.json()["data"]] == [("jobs", 0), ("jobs", 1000)]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_a_negative_priority_on_the_synchronous_endpoints_is_refused_without_the_allowance(stack, fresh_key, url):
    key, _ = fresh_key
    body = CHAT if url == "/v1/chat/completions" else job()
    with stack.client(key) as client:
        refused = client.post(url, json={**body, "priority": -1000})
        streamed = client.post(url, json={**body, "priority": -1, "stream": True})
        assert _no_jobs(client)
        # Their own class: service_tier "priority" asks for nothing more, and priority >= 0 orders own work.
        answered = client.post(url, json={**body, "service_tier": "priority", "priority": 7})
        row = client.get("/v1/jobs", params={"limit": 1}).json()["data"][0]
    assert_not_allowed(refused, "priority", "priority >= 0", "--min-priority -1000")
    assert_not_allowed(streamed, "priority")
    assert answered.status_code == 200, answered.text
    assert (row["work_class"], row["priority"]) == ("interactive", 7)


def _upload_batch(client, bodies: list[dict], url: str = "/v1/completions") -> dict:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body} for i, body in enumerate(bodies)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.post("/v1/files", files={"file": ("b.jsonl", content)}, data={"purpose": "batch"}).json()["id"]
    created = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": url, "completion_window": "24h"})
    assert created.status_code == 200, created.text
    deadline = time.monotonic() + 60
    while (batch := client.get(f"/v1/batches/{created.json()['id']}").json())["status"] != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def _errors_by_line(client, batch: dict) -> dict[str, str]:
    if batch["error_file_id"] is None:
        return {}
    text = client.get(f"/v1/files/{batch['error_file_id']}/content").text
    lines = [json.loads(line) for line in text.splitlines()]
    return {line["custom_id"]: line["response"]["body"]["error"]["message"] for line in lines}


BATCH_BODIES = [job("plain"), job("tier", service_tier="priority"), job("ahead", priority=-2), job("own", priority=3)]


def test_batch_api_lines_asking_beyond_the_allowance_fail_as_their_own_errors(stack, fresh_key):
    key, _ = fresh_key
    with stack.client(key) as client:
        batch = _upload_batch(client, BATCH_BODIES)
        errors = _errors_by_line(client, batch)
        rows = client.get("/v1/jobs", params={"batch_id": batch["id"], "limit": 10}).json()["data"]
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert set(errors) == {"line-1", "line-2"}
    assert 'service_tier "priority"' in errors["line-1"] and "--allow-priority-tier" in errors["line-1"]
    assert "priority -2" in errors["line-2"] and "priority >= 0" in errors["line-2"]
    # What ran stayed in the batch class at priority 0: nothing a line asks moves a Batch API line.
    assert {(r["work_class"], r["priority"]) for r in rows if r["status"] == "succeeded"} == {("batch", 0)}


def test_a_granted_key_may_use_its_grant_and_no_more(stack, stack_sessions):
    key = _granted_key(stack_sessions, allow_priority_tier=True, min_priority=-10)
    with stack.client(key) as client:
        tiered = client.post("/v1/jobs", json=[job(service_tier="priority"), job(priority=-10)])
        chat = client.post("/v1/chat/completions", json={**CHAT, "priority": -10})
        below = client.post("/v1/jobs", json=job(priority=-11))
        batch = _upload_batch(client, BATCH_BODIES)
        assert [wait_terminal(client, i)["status"] for i in tiered.json()["ids"]] == ["succeeded"] * 2
    assert tiered.status_code == 202, tiered.text
    assert [(j["work_class"], j["priority"]) for j in tiered.json()["data"]] == [("interactive", 0), ("jobs", -10)]
    assert chat.status_code == 200, chat.text
    assert_not_allowed(below, "priority", "priority >= -10", "--min-priority -11")
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}


def test_the_admin_may_use_every_class_and_priority(stack):
    with stack.client() as admin:
        created = admin.post("/v1/jobs", json=[job(service_tier="priority", priority=-1000), job(priority=-1)])
        chat = admin.post("/v1/chat/completions", json={**CHAT, "priority": -1000})
        batch = _upload_batch(admin, BATCH_BODIES)
        assert [wait_terminal(admin, i)["status"] for i in created.json()["ids"]] == ["succeeded"] * 2
    assert created.status_code == 202, created.text
    assert [(j["work_class"], j["priority"]) for j in created.json()["data"]] == [("interactive", -1000), ("jobs", -1)]
    assert chat.status_code == 200, chat.text
    assert batch["request_counts"]["failed"] == 0


def test_a_grant_applies_to_the_next_request_and_can_be_taken_back(stack, stack_sessions, fresh_key):
    key, _ = fresh_key
    with stack.client(key) as client:
        assert client.post("/v1/jobs", json=job(service_tier="priority", priority=-5)).status_code == 403
        grant_key(stack_sessions, key[:12], allow_priority_tier=True, min_priority=-5)
        granted = client.post("/v1/jobs", json=job(service_tier="priority", priority=-5))
        grant_key(stack_sessions, key[:12], allow_priority_tier=False, min_priority=0)
        taken_back = client.post("/v1/jobs", json=job(service_tier="priority"))
    assert granted.status_code == 202 and granted.json()["data"][0]["work_class"] == "interactive"
    assert_not_allowed(taken_back, "service_tier")


def test_keys_cli_creates_grants_and_lists_allowances(stack):
    def tokenloom(*args, expect: int = 0) -> subprocess.CompletedProcess:
        return keys_cli(stack, *args, expect=expect)

    project = f"cli-{uuid.uuid4().hex[:8]}"
    key = tokenloom("create", "--project", project, "--allow-priority-tier", "--min-priority", "-5").stdout.strip()
    assert tokenloom("create", "--project", project, "--min-priority", "5", expect=2).stderr.count("[-1000, 0]") == 1
    with stack.client(key) as client:
        assert client.post("/v1/jobs", json=job(service_tier="priority", priority=-5)).status_code == 202
        tokenloom("grant", key[:12], "--no-allow-priority-tier", "--min-priority", "0")
        assert_not_allowed(client.post("/v1/jobs", json=job(service_tier="priority")), "service_tier")
        assert_not_allowed(client.post("/v1/jobs", json=job(priority=-5)), "priority")
    listed = [json.loads(line) for line in tokenloom("list", "--json").stdout.splitlines()]
    mine = [row for row in listed if row["project"] == project]
    assert [(row["allow_priority_tier"], row["min_priority"]) for row in mine] == [(False, 0)]
    assert "no priority tier, priority >= 0" in tokenloom("list").stdout
    assert "nothing to grant" in tokenloom("grant", key[:12], expect=2).stderr
