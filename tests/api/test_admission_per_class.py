"""Admission per class of work (api/admission.py) through the real API: a project with 100,000 queued
batch lines still gets its chat and completion requests answered; its batches are bounded by
[server] max_queued_batch_lines, its chat and /v1/jobs work by max_queued_jobs, each on its own.

The backlog is written straight into the stack's database (one INSERT ... SELECT generate_series)
under a model no worker serves, so no worker ever claims it; admission counts a project's open jobs
across models, so they count against the project all the same."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from sqlalchemy import delete, text

from tests.api.conftest import MAX_QUEUED_BATCH_LINES, MAX_QUEUED_JOBS
from tests.api.test_jobs_e2e import job, wait_terminal
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.celery_app import queue_keys
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job

BROKER_URL = "redis://127.0.0.1:6379/0"  # the stack's ([queue] broker_url's default)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _insert_queued(stack_sessions, count: int, project: str, model: str, work_class: WorkClass) -> None:
    with stack_sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO jobs (id, project, model, endpoint, prompt, params, status, work_class, priority, "
                "attempts, created_at) SELECT gen_random_uuid(), :project, :model, '/v1/chat/completions', 'line', "
                "'{}', 'queued', :work_class, 0, 0, now() FROM generate_series(1, :count)"
            ),
            {"project": project, "model": model, "work_class": work_class.value, "count": count},
        )


@pytest.fixture
def flooded(stack_sessions):
    """A project of its own with MAX_QUEUED_BATCH_LINES (100,000) queued batch lines: (project, its key,
    the backlog's model). Its rows, and any message a worker's stranded-job sweep sent for them, go after."""
    project = f"flood-{uuid.uuid4().hex[:8]}"
    model = f"backlog-{uuid.uuid4().hex[:8]}"
    key, _ = create_key(stack_sessions, project)
    _insert_queued(stack_sessions, MAX_QUEUED_BATCH_LINES, project, model, WorkClass.BATCH)
    yield project, key, model
    with stack_sessions.begin() as session:
        session.execute(delete(Job).where(Job.project == project, Job.model == model))
    client = redis.Redis.from_url(BROKER_URL)
    client.delete(*queue_keys(model))
    client.close()


def test_a_batch_backlog_never_refuses_the_projects_chat_and_each_class_keeps_its_limit(stack, stack_sessions, flooded):
    project, key, model = flooded
    batch_file = json.dumps(
        {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    ).encode()
    with stack.client(key) as client:
        chat = client.post("/v1/chat/completions", json=CHAT)
        completion = client.post("/v1/completions", json=job())
        polled = client.post("/v1/jobs", json=job())
        file_id = client.post(
            "/v1/files", files={"file": ("one.jsonl", batch_file + b"\n")}, data={"purpose": "batch"}
        ).json()["id"]
        batch = client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        flex = client.post("/v1/chat/completions", json={**CHAT, "service_tier": "flex"})  # the batch class
        assert wait_terminal(client, polled.json()["ids"][0])["status"] == "succeeded"

        # Now the project's chat and /v1/jobs work is at its own limit: both answer 429.
        _insert_queued(stack_sessions, MAX_QUEUED_JOBS, project, model, WorkClass.JOBS)
        over_jobs = client.post("/v1/jobs", json=job())
        over_chat = client.post("/v1/chat/completions", json=CHAT)

    # 100,000 queued batch lines: the project's chat and completion requests are answered.
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert completion.status_code == 200, completion.text
    assert polled.status_code == 202, polled.text
    # Its batch lines are at their own limit: a batch, or a flex request (batch class), gets 429.
    for refused in (batch, flex):
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0, refused.text
        assert "max_queued_batch_lines" in refused.json()["error"]["message"]
        assert f"{MAX_QUEUED_BATCH_LINES:,} batch lines" in refused.json()["error"]["message"]
    for refused in (over_jobs, over_chat):
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0, refused.text
        assert "max_queued_jobs" in refused.json()["error"]["message"]
