"""A request is tokenized once: the API encodes it (chat template applied) and stores the ids with
the job; the worker's engine runs those ids and never calls its tokenizer for the prompt.

The API's half is its real job builder (api/job_request.py) over the real ServedModel; the worker's
half a real WorkerRuntime with its own engine on a real Postgres and Redis. Each side's
PromptEncoder counts its encode calls.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.api.conftest import stack_config
from tests.conftest import ORACLE_CONFIG
from tests.services import fresh_pg_database
from tokenloom.api.auth import Principal
from tokenloom.api.job_request import build_job
from tokenloom.api.served_model import ServedModel
from tokenloom.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.store import migrate
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.work_class import WorkClass
from tokenloom.store.models import Job, JobStatus


class EncodeCounter:
    """Wraps one PromptEncoder's text and chat encoders, counting calls."""

    def __init__(self, encoder, monkeypatch):
        self.calls = 0
        for name in ("encode_text", "encode_messages"):
            original = getattr(encoder, name)
            monkeypatch.setattr(encoder, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return counted


@pytest.fixture
def checkpoint(tmp_path):
    return build_random_checkpoint(tmp_path / f"once-{uuid.uuid4().hex[:8]}", **ORACLE_CONFIG)


def test_each_job_is_tokenized_by_the_api_only(checkpoint, monkeypatch):
    with fresh_pg_database() as db_url:
        migrate.upgrade(db_url)
        config = stack_config(checkpoint, db_url)
        served = ServedModel.load(config.model, config.sampling)
        api_calls = EncodeCounter(served.encoder, monkeypatch)
        caller = Principal("p", is_admin=False)
        jobs = [
            build_job(
                {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}, served, caller, WorkClass.JOBS
            ),
            build_job(
                {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0},
                served,
                caller,
                WorkClass.JOBS,
            ),
        ]
        assert api_calls.calls == 2 and all(job.prompt_token_ids for job in jobs)
        sessions = make_session_factory(make_sql_engine(db_url))
        with sessions.begin() as session:
            session.add_all(jobs)
        engine = Engine(config)
        worker_calls = EncodeCounter(engine.loaded.encoder, monkeypatch)
        from tokenloom.worker.runtime import WorkerRuntime

        runtime = WorkerRuntime(config, make_celery(config.queue.broker_url), engine=engine)
        try:
            runtime.runner.run([str(job.id) for job in jobs])
            rows = _wait_terminal(sessions, [job.id for job in jobs])
        finally:
            runtime.close()
    assert [row.status for row in rows] == [JobStatus.SUCCEEDED] * 2, [row.error for row in rows]
    assert [row.prompt_tokens for row in rows] == [len(job.prompt_token_ids) for job in jobs]
    assert worker_calls.calls == 0  # the engine ran the API's ids


def _wait_terminal(sessions, job_ids, timeout_s: float = 120.0) -> list[Job]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with sessions() as session:
            rows = [session.get(Job, job_id) for job_id in job_ids]
        if all(row.status.is_terminal for row in rows):
            return rows
        time.sleep(0.05)
    raise AssertionError("jobs did not finish")
