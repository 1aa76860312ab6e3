"""Faults on the API's side, with a real `tokenloom serve` process, a real worker, Redis, Postgres:

- the API is SIGKILLed during an SSE stream and started again: the job (owned by the worker, not
  the connection) still completes with the fault-free greedy output and is readable by its id;
- Postgres goes away while the API accepts jobs (the API reaches it through a TCP proxy that is
  cut, which is what a Postgres restart looks like to clients): the API answers 503 with
  Retry-After, never 500, and accepts again once the database is back. The worker talks to
  Postgres directly, so every accepted job also completes.
"""

from __future__ import annotations

import json
import time

import httpx

from tests.reliability.conftest import STALL_MARKER, expected_tokens
from tests.reliability.report import report_row


def _wait_job(client: httpx.Client, job_id: str, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout_s}s"
        time.sleep(0.2)


def _call(client: httpx.Client, method: str, path: str, **kwargs) -> tuple:
    """(request, status or transport error, Retry-After, JSON body): never raises, so every
    answer given during an outage can be judged."""
    try:
        response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        return f"{method} {path}", f"{type(exc).__name__}: {exc}", None, None
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"type": None}, "text": response.text[:200]}
    return f"{method} {path}", response.status_code, response.headers.get("Retry-After"), body


def test_api_killed_during_an_sse_stream(api_stack):
    # Stalled by the stack's worker (>= 10 s, on any CPU): the job is still generating when the API dies.
    prompt, max_tokens = f"{STALL_MARKER} The API restarts but the job goes on", 200
    stack = api_stack
    body = {
        "model": stack.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    streamed, broken = "", None
    with stack.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        job_id = response.headers["X-Job-Id"]
        lines = response.iter_lines()
        try:
            for line in lines:
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
                    if len(streamed) >= 10:
                        break
            stack.api.kill()  # mid-stream: tokens are still being generated
            killed_at = time.monotonic()
            for line in lines:  # must end (an error), not hang, once the server is gone
                pass
        except httpx.HTTPError as exc:
            broken = exc
    assert broken is not None, "the stream should break when the API dies"
    stack.api.start()
    recovery_s = time.monotonic() - killed_at
    with stack.client() as client:
        job = _wait_job(client, job_id)
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 1  # the worker never noticed: the job is not tied to the connection
    assert job["output_text"].startswith(streamed)
    assert (
        job["output_token_ids"]
        == expected_tokens(stack.checkpoint, [{"custom_id": "x", "prompt": prompt, "max_tokens": max_tokens}])["x"]
    )
    report_row(
        "API SIGKILLed during an SSE stream, restarted",
        1,
        1,
        0,
        0,
        recovery_s,
        "kill -> restarted API answers /healthz; the job is then readable by id",
    )


def test_postgres_outage_while_the_api_accepts_jobs(api_stack):
    stack = api_stack
    job = {
        "model": stack.model,
        "prompt": "accepted through an outage",
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    accepted: list[str] = []
    with stack.client() as client:
        first = client.post("/v1/jobs", json=job)
        assert first.status_code == 202, first.text
        accepted += first.json()["ids"]
        stack.proxy.cut()
        try:
            during = [
                _call(client, "POST", "/v1/jobs", json=job),
                _call(client, "GET", f"/v1/jobs/{accepted[0]}"),
                _call(client, "GET", "/v1/jobs"),
            ]
        finally:
            stack.proxy.restore()
        restored_at = time.monotonic()
        answers = []
        deadline = restored_at + 30
        while True:  # every answer until it accepts again must be a 503 too, never a 500
            response = _call(client, "POST", "/v1/jobs", json=job)
            if response[1] == 202:
                accepted += response[3]["ids"]
                break
            answers.append(response)
            assert time.monotonic() < deadline, f"API did not accept jobs again: {response}"
            time.sleep(0.2)
        recovery_s = time.monotonic() - restored_at
        finished = [_wait_job(client, job_id) for job_id in accepted]
    bad = [
        answer
        for answer in during + answers
        if answer[1] != 503 or answer[2] is None or answer[3]["error"]["type"] != "service_unavailable"
    ]
    assert not bad, f"expected 503 + Retry-After during the outage, got: {bad}"
    assert [j["status"] for j in finished] == ["succeeded"] * len(accepted)
    report_row(
        "Postgres unreachable while the API accepts jobs (503 + Retry-After)",
        len(accepted),
        len(finished),
        0,
        len(accepted) - len(finished),
        recovery_s,
        "database back -> API accepts a job again",
    )


def test_redis_restart_while_the_api_accepts_jobs(api_stack):
    """Redis (no persistence) restarted under the API and the worker: while it is down the API
    answers 503 with Retry-After; afterwards both reconnect by themselves and new jobs run."""
    stack = api_stack
    job = {
        "model": stack.model,
        "prompt": "accepted around a Redis restart",
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with stack.client() as client:
        stack.redis.stop()
        try:
            during = [
                _call(client, "POST", "/v1/jobs", json=job),
                _call(client, "POST", "/v1/completions", json={**job, "stream": True}),
            ]
        finally:
            stack.redis.start()  # empty
        restarted_at = time.monotonic()
        accepted, deadline = [], restarted_at + 30
        while not accepted:
            response = _call(client, "POST", "/v1/jobs", json=job)
            if response[1] == 202:
                accepted = response[3]["ids"]
            else:
                during.append(response)
                assert time.monotonic() < deadline, f"API did not accept jobs again: {response}"
                time.sleep(0.2)
        finished = [_wait_job(client, job_id, timeout_s=60) for job_id in accepted]
        recovery_s = time.monotonic() - restarted_at
    bad = [answer for answer in during if answer[1] != 503 or answer[2] is None]
    assert not bad, f"expected 503 + Retry-After while Redis is down, got: {bad}"
    assert [j["status"] for j in finished] == ["succeeded"]
    report_row(
        "Redis restarted under the API and worker",
        len(accepted),
        len(finished),
        0,
        len(accepted) - len(finished),
        recovery_s,
        "Redis back -> a new job accepted and finished",
    )
