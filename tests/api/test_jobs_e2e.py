"""/v1/jobs, keys and tenants, limits and probes over HTTP (httpx) against the real stack."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.api.conftest import MAX_BODY_MB, MAX_QUEUED_JOBS, STALL_MARKER, WORKER_CLAIMS, keys_cli
from tests.services import REPO_ROOT
from tokenloom.engine.testing.fault_injection import STALL_STEP_S
from tokenloom.store.api_keys.key_queries import create_key

TERMINAL = ("succeeded", "failed", "cancelled")


def wait_terminal(client, job_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def wait_running(client, job_ids: list[str], at_least: int, timeout_s: float = 60) -> dict[str, str]:
    """Each job's status once at least `at_least` of them run (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {i: client.get(f"/v1/jobs/{i}").json()["status"] for i in job_ids}
        if sum(s == "running" for s in statuses.values()) >= at_least or time.monotonic() > deadline:
            return statuses
        time.sleep(0.1)


def job(prompt: str = "The engine", **fields) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}


def test_a_job_runs_and_reports_its_output_counts_and_timings(stack):
    with stack.client(stack.project_keys["lab-a"]) as client:
        created = client.post("/v1/jobs", json=job(custom_id="one"))
        assert created.status_code == 202, created.text
        job_id = created.json()["ids"][0]
        assert created.json()["data"][0]["status"] == "queued"
        done = wait_terminal(client, job_id)
        same_online = client.post("/v1/completions", json=job()).json()
    assert done["status"] == "succeeded", done["error"]
    assert done["project"] == "lab-a" and done["custom_id"] == "one"
    assert done["completion_tokens"] == 8 and len(done["output_token_ids"]) == 8 and done["prompt_tokens"] > 0
    assert all(done[k] is not None and done[k] >= 0 for k in ("ttft_s", "tpot_s", "queue_s", "e2e_s"))
    assert done["output_text"] == same_online["choices"][0]["text"]  # greedy: the same text either way


def test_a_list_of_jobs_is_queued_together_and_pages_newest_first(stack):
    with stack.client(stack.project_keys["lab-b"]) as client:
        created = client.post("/v1/jobs", json=[job(f"list {i}", custom_id=f"c{i}") for i in range(3)])
        assert created.status_code == 202, created.text
        ids = created.json()["ids"]
        assert [wait_terminal(client, i)["status"] for i in ids] == ["succeeded"] * 3
        first = client.get("/v1/jobs", params={"limit": 2}).json()
        second = client.get("/v1/jobs", params={"limit": 2, "after": first["last_id"]}).json()
        succeeded = client.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()
    assert first["has_more"] is True and len(first["data"]) == 2
    paged = [j["id"] for j in first["data"] + second["data"]]
    assert len(set(paged)) == len(paged) and set(ids) <= set(paged) | {j["id"] for j in succeeded["data"]}
    assert {j["project"] for j in succeeded["data"]} == {"lab-b"}


def test_a_project_key_sees_only_its_projects_jobs_and_the_admin_sees_all(stack):
    with (
        stack.client(stack.project_keys["lab-a"]) as a,
        stack.client(stack.project_keys["lab-b"]) as b,
        stack.client() as admin,
    ):
        job_id = a.post("/v1/jobs", json=job()).json()["ids"][0]
        assert b.get(f"/v1/jobs/{job_id}").status_code == 404
        assert b.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert job_id not in {j["id"] for j in b.get("/v1/jobs", params={"limit": 1000}).json()["data"]}
        assert admin.get(f"/v1/jobs/{job_id}").json()["project"] == "lab-a"
        assert wait_terminal(a, job_id)["status"] == "succeeded"


def test_cancel_ends_a_queued_job_at_once_and_it_never_runs(stack):
    # The worker holds WORKER_CLAIMS jobs at a time, so of 8 more long jobs some wait in the queue. Stalled,
    # none of the running ones can end (and free a thread) in under 240 * STALL_STEP_S = 12 s, so a job
    # seen queued once the worker is full stays queued until it is cancelled. (Which jobs the worker
    # took is read from their rows, not assumed from the order they were sent in.)
    assert 240 * STALL_STEP_S >= 12
    with stack.client() as client:
        ids = client.post(
            "/v1/jobs", json=[job(f"{STALL_MARKER} long {i}", max_tokens=240) for i in range(WORKER_CLAIMS + 8)]
        ).json()["ids"]
        statuses = wait_running(client, ids, at_least=WORKER_CLAIMS)
        queued = [i for i in ids if statuses[i] == "queued"]
        assert queued, f"the worker took all {len(ids)} jobs: {statuses}"
        cancelled = client.post(f"/v1/jobs/{queued[-1]}/cancel")
        others = [client.post(f"/v1/jobs/{i}/cancel").json()["status"] for i in ids if i != queued[-1]]
        finals = {i: wait_terminal(client, i) for i in ids}
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert set(others) <= {"cancelled", "cancelling", "succeeded"}
    assert finals[queued[-1]]["status"] == "cancelled" and finals[queued[-1]]["completion_tokens"] is None
    assert all(f["status"] in ("cancelled", "succeeded") for f in finals.values())


@pytest.mark.parametrize(
    "key, status, code",
    [
        (None, 401, "missing_api_key"),
        ("tlk-not-a-real-key", 401, "invalid_api_key"),
        ("revoked", 403, "key_revoked"),
    ],
)
def test_requests_without_a_valid_key_are_refused(stack, key, status, code):
    with stack.client(stack.revoked_key if key == "revoked" else key) as client:
        reply = client.get("/v1/jobs")
    assert reply.status_code == status and reply.json()["error"]["code"] == code


def test_bad_job_bodies_get_errors_that_name_the_problem(stack):
    with stack.client() as client:
        bad_item = client.post("/v1/jobs", json=[job(), job(top_p=0.5, min_tokens=50)])
        unknown = client.post("/v1/jobs", json=job(colour="blue"))
        too_big = client.post(
            "/v1/jobs",
            content=b'{"prompt": "' + b"x" * (MAX_BODY_MB * 2**20) + b'"}',
            headers={"content-type": "application/json"},
        )
        not_json = client.post("/v1/jobs", content=b"{nope", headers={"content-type": "application/json"})
        missing = client.get("/v1/jobs/00000000-0000-0000-0000-000000000000")
    assert bad_item.status_code == 400 and bad_item.json()["error"]["message"].startswith("item 1: min_tokens")
    # An unknown field is ignored with a warning header (a 400 under [server] strict_fields).
    assert unknown.status_code == 202 and unknown.headers["x-tokenloom-ignored-fields"] == "colour"
    assert too_big.status_code == 413 and "max_body_mb" in too_big.json()["error"]["message"]
    assert not_json.status_code == 422 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_a_project_over_its_queued_job_bound_gets_429_with_retry_after(stack, stack_sessions):
    # A project of its own: jobs other tests left queued or running must not count against the bound.
    key, _ = create_key(stack_sessions, f"bound-{uuid.uuid4().hex[:8]}")
    with stack.client(key) as client:
        too_many = client.post("/v1/jobs", json=[job()] * (MAX_QUEUED_JOBS + 1))  # can never fit: 400
        # Stalled: none of them can end (and make room) in under 200 * STALL_STEP_S = 10 s.
        ids = client.post("/v1/jobs", json=[job(STALL_MARKER, max_tokens=200)] * MAX_QUEUED_JOBS).json()["ids"]
        reply = client.post("/v1/jobs", json=job())  # fits once some of those end: 429
        for job_id in ids:
            client.post(f"/v1/jobs/{job_id}/cancel")
    assert too_many.status_code == 400 and "max_queued_jobs" in too_many.json()["error"]["message"]
    assert reply.status_code == 429 and int(reply.headers["retry-after"]) > 0
    assert "max_queued_jobs" in reply.json()["error"]["message"]


def test_probes_report_ready_with_a_live_worker(stack):
    with stack.client(None) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"database": "ok", "redis": "ok", "worker": "ok"}


def test_keys_cli_creates_lists_and_revokes_a_key(stack):
    def tokenloom(*args):
        return keys_cli(stack, *args).stdout

    key = tokenloom("create", "--project", "inference-lab", "--name", "cli").strip()
    with stack.client(key) as client:
        assert client.get("/v1/jobs").status_code == 200
        assert key[:12] in tokenloom("list")
        tokenloom("revoke", key[:12])
        assert client.get("/v1/jobs").status_code == 403
