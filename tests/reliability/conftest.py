"""Fault-test fixtures: a private Redis that can be restarted, a Postgres that can be cut off
(through tests/reliability/tcp_proxy.py), a tiny model, and job submission/wait helpers.

Every test gets its own Postgres database and (where it restarts Redis) its own redis-server on a
free port, so a fault never touches the services other tests use.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from tests.conftest import engine_config
from tests.services import fresh_pg_database
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.store import migrate
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine
from tokenloom.store.jobs.job_service import submit_file
from tokenloom.store.jobs.streams import stream_key
from tokenloom.store.models import TERMINAL_JOB_STATUSES, Job, JobStatus

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def fault_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama that can write long outputs (jobs must still be running when hit)."""
    return build_random_checkpoint(
        tmp_path_factory.mktemp("fault-model") / "llama",
        seed=7,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.1,
    )


@pytest.fixture
def pg_db() -> Iterator[str]:
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def sessions(pg_db):
    engine = make_sql_engine(pg_db)
    yield make_session_factory(engine)
    engine.dispose()


# --- a private Redis -------------------------------------------------------------------------------


@dataclass
class RedisServer:
    port: int
    workdir: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # No persistence, like this machine's and many deployments' Redis: a restart loses every
        # queued message, which the reconciler must make up for from Postgres.
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while (
            subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True).stdout.strip() != b"PONG"
        ):
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required for the fault tests (Debian package redis-server)")
    server = RedisServer(_free_port(), tmp_path)
    server.start()
    yield server
    server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- jobs -----------------------------------------------------------------------------------------


def worker_settings(checkpoint: Path, database_url: str, broker_url: str, max_num_seqs: int, **extra) -> dict:
    return {
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_DTYPE": "float32",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TOKENLOOM_DATABASE_URL": database_url,
        "TOKENLOOM_QUEUE_BROKER_URL": broker_url,
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(max_num_seqs),
        **{f"TOKENLOOM_{key.upper()}": str(value) for key, value in extra.items()},
    }


# Jobs that must still be running when a test hits them (SIGTERM, SIGKILL, an outage), on any CPU:
# a worker started with stalling(settings) (engine/testing/fault_injection.py's stall) makes at most one token
# per STALL_STEP_S for a prompt holding STALL_MARKER, so such a job cannot end by itself in under
# max_tokens * STALL_STEP_S seconds. Workers without it run the same prompts at full speed (the
# marker is only text), with the same greedy tokens.
STALL_MARKER = "RELIABILITY-STALL"


def stalling(settings: dict) -> dict:
    """Worker settings that stall prompts holding STALL_MARKER (job_lines(..., stalled=True))."""
    return {**settings, "TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}"}


def job_lines(num_jobs: int, max_tokens: int, prefix: str = "c", stalled: bool = False) -> list[dict]:
    mark = f"{STALL_MARKER} " if stalled else ""
    return [
        {
            "custom_id": f"{prefix}{i}",
            "prompt": f"{mark}{prefix} job {i}: {'the queue ' * (i % 5)}keeps every job",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(num_jobs)
    ]


def running_with_tokens(sessions, batch_id: uuid.UUID, broker_url: str) -> int:
    """How many of the batch's jobs are running and have streamed at least one token."""
    client = redis.Redis.from_url(broker_url)
    try:
        return sum(
            any(b'"event": "delta"' in fields[b"data"] for _, fields in client.xrange(stream_key(job.id)))
            for job in jobs_of(sessions, batch_id)
            if job.status is JobStatus.RUNNING
        )
    finally:
        client.close()


GROUP_SIZE = 4


def submit(
    sessions, broker_url: str, checkpoint: Path, lines: list[dict], tmp_path: Path, project: str = "default"
) -> uuid.UUID:
    source = tmp_path / f"batch-{uuid.uuid4().hex[:6]}.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # Groups of GROUP_SIZE jobs per message, as batches are sent: a fault hits a worker mid-group.
    return submit_file(
        sessions, make_celery(broker_url), source, str(checkpoint), project, group_size=GROUP_SIZE
    ).batch_id


def expected_tokens(checkpoint: Path, lines: list[dict]) -> dict[str, list[int]]:
    """custom_id -> greedy token ids from the in-process engine: what a fault-free run writes."""
    engine = Engine(engine_config(checkpoint, model=dict(max_model_len=MAX_MODEL_LEN)))
    outputs = engine.generate(
        [line["prompt"] for line in lines],
        SamplingParams(temperature=0.0, max_tokens=lines[0]["max_tokens"], ignore_eos=True),
    )
    return {line["custom_id"]: out.outputs[0].token_ids for line, out in zip(lines, outputs)}


def jobs_of(sessions, batch_id: uuid.UUID) -> list[Job]:
    with sessions() as session:
        return list(session.execute(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_number)).scalars())


def count_status(sessions, batch_id: uuid.UUID, *statuses) -> int:
    with sessions() as session:
        return session.execute(
            select(func.count()).select_from(Job).where(Job.batch_id == batch_id, Job.status.in_(statuses))
        ).scalar_one()


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
    return value


def wait_all_terminal(sessions, batch_id: uuid.UUID, total: int, timeout_s: float) -> list[Job]:
    wait_until(
        lambda: count_status(sessions, batch_id, *TERMINAL_JOB_STATUSES) == total, timeout_s, f"all {total} jobs to end"
    )
    return jobs_of(sessions, batch_id)


# The shared API + worker stack (a session fixture must live in a conftest to be shared).
from tests.reliability.api_stack import api_stack  # noqa: E402,F401
