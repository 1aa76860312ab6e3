"""A job that ends without output answers by its row's error code, one mapping for both paths:
the non-streaming request gets the code's HTTP status, the streamed one an error event of the same
type and code (JobErrorCode.http_status: invalid_request -> 400, cancelled -> 409, the rest 500).

A real API on a real Postgres and Redis with no worker: each request's job stays queued until the
test ends it with a code, as a worker or the store would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from sqlalchemy import select, update

from tests.api.conftest import ADMIN_KEY, ThreadedServer, free_port, stack_config
from tests.conftest import ORACLE_CONFIG
from tests.services import fresh_pg_database
from tokenloom.api.app import create_app
from tokenloom.api.errors import ERROR_TYPES
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.store import migrate
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.models import Job, JobErrorCode, JobStatus, utcnow

EXPECTED_STATUS = {
    JobErrorCode.INVALID_REQUEST: 400,
    JobErrorCode.ENGINE_ERROR: 500,
    JobErrorCode.GAVE_UP: 500,
    JobErrorCode.QUEUE_UNAVAILABLE: 500,
    JobErrorCode.RESULT_UNSTORED: 500,
    JobErrorCode.CANCELLED: 409,
    JobErrorCode.BATCH_EXPIRED: 409,
}


def test_every_code_has_its_status():
    assert {code: code.http_status for code in JobErrorCode} == EXPECTED_STATUS


@pytest.fixture(scope="module")
def workerless_api(tmp_path_factory):
    # A model of its own: its queue name is its path, so no other test's worker takes these jobs.
    checkpoint = build_random_checkpoint(
        tmp_path_factory.mktemp("codes") / f"codes-{uuid.uuid4().hex[:8]}", **ORACLE_CONFIG
    )
    with fresh_pg_database() as db_url:
        migrate.upgrade(db_url)
        sessions = make_session_factory(make_sql_engine(db_url))
        port = free_port()
        with ThreadedServer(create_app(stack_config(checkpoint, db_url), admin_key=ADMIN_KEY), port):
            yield f"http://127.0.0.1:{port}", sessions, str(checkpoint)


def _end_the_queued_job(sessions, code: JobErrorCode) -> None:
    """Wait for the request's job row, then end it as the failure `code` names."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with sessions.begin() as session:
            job_id = session.scalar(select(Job.id).where(Job.status == JobStatus.QUEUED))
            if job_id is not None:
                status = JobStatus.CANCELLED if code is JobErrorCode.CANCELLED else JobStatus.FAILED
                session.execute(
                    update(Job)
                    .where(Job.id == job_id)
                    .values(status=status, error_code=code, error=f"ended as {code.value}", finished_at=utcnow())
                )
                return
        time.sleep(0.05)
    raise AssertionError("the request's job row never appeared")


def _in_background(sessions, code: JobErrorCode) -> threading.Thread:
    thread = threading.Thread(target=_end_the_queued_job, args=(sessions, code), daemon=True)
    thread.start()
    return thread


BODY = {"prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("code", [c for c in JobErrorCode if c is not JobErrorCode.CANCELLED], ids=lambda c: c.value)
def test_a_non_streamed_request_answers_with_its_codes_status(workerless_api, code):
    url, sessions, model = workerless_api
    ender = _in_background(sessions, code)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as client:
        response = client.post("/v1/completions", json={**BODY, "model": model})
    ender.join()
    assert response.status_code == code.http_status, response.text
    error = response.json()["error"]
    assert error["code"] == code.value and error["type"] == ERROR_TYPES.get(code.http_status, "server_error")
    assert f"ended as {code.value}" in error["message"]


@pytest.mark.parametrize("code", [c for c in JobErrorCode if c is not JobErrorCode.CANCELLED], ids=lambda c: c.value)
def test_a_streamed_request_ends_with_an_error_of_the_same_type_and_code(workerless_api, code):
    url, sessions, model = workerless_api
    ender = _in_background(sessions, code)
    events = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**BODY, "model": model, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
    ender.join()
    errors = [event["error"] for event in events if "error" in event]
    assert len(errors) == 1, events
    assert errors[0]["code"] == code.value
    assert errors[0]["type"] == ERROR_TYPES.get(code.http_status, "server_error")


def test_the_job_resource_names_the_code_and_its_type(workerless_api):
    url, sessions, model = workerless_api
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as client:
        created = client.post("/v1/jobs", json={**BODY, "model": model})
        assert created.status_code < 300, created.text
        _end_the_queued_job(sessions, JobErrorCode.GAVE_UP)
        job_id = created.json()["id"] if "id" in created.json() else created.json()["data"][0]["id"]
        error = client.get(f"/v1/jobs/{job_id}").json()["error"]
    assert error == {"message": "ended as gave_up", "type": "server_error", "code": "gave_up"}
