"""The API against real services: uvicorn on a loopback port (in a thread of the test process), a
fresh migrated Postgres database, Redis, and a real `tokenloom worker` subprocess with a tiny
random-weights Llama. One stack per test session keeps tests/api fast.

The checkpoint directory gets a unique name: queues are named after it (store/celery_app.py),
so a worker from another concurrent test run on the same Redis never takes our jobs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.conftest import ORACLE_CONFIG
from tests.services import REPO_ROOT, fresh_pg_database, running_worker
from tokenloom.api.app import create_app
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.settings.config import load_config
from tokenloom.store import migrate
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.database import make_session_factory, make_sql_engine

ADMIN_KEY = "tl-admin-" + uuid.uuid4().hex
MAX_MODEL_LEN = 256
MAX_BODY_MB = 1
MAX_QUEUED_JOBS = 40
MAX_QUEUED_BATCH_LINES = 100_000  # per project: tests/api/test_admission_per_class.py fills it
MAX_FILE_MB = 2
MAX_BATCH_LINES = 30
# The stack's worker stalls prompts holding this marker (engine/testing/fault_injection.py): at most one
# token per STALL_STEP_S, so such a job cannot end by itself in under max_tokens * STALL_STEP_S
# seconds on any CPU. Tests that must act while a job is queued or running use it.
WORKER_THREADS = 24  # the stack worker's claim threads
MAX_NUM_SEQS = 16
WORKER_CLAIMS = 2 * MAX_NUM_SEQS  # how many jobs the worker holds claimed at once (worker/runtime.py)
STALL_MARKER = "~STALL~"  # short: the tiny tokenizer spells most words letter by letter


@dataclass(slots=True)
class Stack:
    base_url: str
    admin_key: str
    project_keys: dict[str, str]  # project -> key
    revoked_key: str
    checkpoint: Path
    model: str
    db_url: str

    def client(self, key: str | None = "admin", **kwargs) -> httpx.Client:
        token = self.admin_key if key == "admin" else key
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60, **kwargs)


def keys_cli(stack: "Stack", *args: str, expect: int = 0) -> subprocess.CompletedProcess:
    """`tokenloom keys ...` against the stack's database, as an admin runs it; asserts its exit status."""
    done = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "keys", *args],
        env={**os.environ, "TOKENLOOM_DATABASE_URL": stack.db_url, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == expect, done.stderr
    return done


def wait_for(predicate, what: str, timeout_s: float = 120):
    """Poll until `predicate` returns something true (the timeout only bounds a failing run)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn in a daemon thread (it installs no signal handlers off the main thread)."""

    def __init__(self, app, port: int):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                pytest.fail("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def api_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("api-checkpoints")
    return build_random_checkpoint(root / f"api-llama-{uuid.uuid4().hex[:8]}", seed=0, **ORACLE_CONFIG)


def stack_config(checkpoint: Path, db_url: str):
    return (
        load_config(None, env={})
        .replace("model", name=str(checkpoint), dtype="float32", max_model_len=MAX_MODEL_LEN)
        .replace("database", url=db_url)
        .replace(
            "server",
            max_body_mb=MAX_BODY_MB,
            max_queued_jobs=MAX_QUEUED_JOBS,
            max_queued_batch_lines=MAX_QUEUED_BATCH_LINES,
            max_file_mb=MAX_FILE_MB,
            max_batch_lines=MAX_BATCH_LINES,
        )
    )


@pytest.fixture(scope="session")
def stack(api_checkpoint, tmp_path_factory):
    with fresh_pg_database() as db_url:
        migrate.upgrade(db_url)
        sessions = make_session_factory(make_sql_engine(db_url))
        keys = {project: create_key(sessions, project)[0] for project in ("lab-a", "lab-b")}
        revoked, info = create_key(sessions, "lab-a", "old")
        from tokenloom.store.api_keys.key_queries import revoke_key

        revoke_key(sessions, str(info.id))
        settings = {
            "TOKENLOOM_MODEL_NAME": str(api_checkpoint),
            "TOKENLOOM_MODEL_DTYPE": "float32",
            "TOKENLOOM_MODEL_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "TOKENLOOM_DATABASE_URL": db_url,
            "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
            "TOKENLOOM_QUEUE_LEASE_S": "3",  # heartbeat (leases, engine figures for /metrics) every second
            "TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}",
        }
        log_path = tmp_path_factory.mktemp("api-worker") / "worker.log"
        app = create_app(stack_config(api_checkpoint, db_url), admin_key=ADMIN_KEY)
        port = free_port()
        with running_worker(settings, WORKER_THREADS, log_path), ThreadedServer(app, port):
            yield Stack(
                f"http://127.0.0.1:{port}", ADMIN_KEY, keys, revoked, api_checkpoint, str(api_checkpoint), db_url
            )


@pytest.fixture(scope="session")
def compose_stack(tmp_path_factory):
    """docker-compose.yml's migrate, api and worker-cpu services as local processes (tests/api/compose_stack.py),
    one per session: the compose smoke, Prometheus and dashboard tests share it."""
    from tests.api.compose_stack import local_compose_stack

    with local_compose_stack(tmp_path_factory.mktemp("compose-stack")) as stack:
        yield stack


@pytest.fixture(scope="session")
def prometheus(compose_stack, tmp_path_factory):
    """A real Prometheus scraping `compose_stack` with monitoring/prometheus.yml (skips without the binary)."""
    from tests.api.prometheus_server import start_prometheus

    server = start_prometheus(compose_stack, tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack_sessions(stack):
    """Sessions on the stack's own database, for tests that read or arrange rows directly."""
    engine = make_sql_engine(stack.db_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def migrated_database():
    """A fresh Postgres database at the head revision of its own: (url, engine, session factory)."""
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        engine = make_sql_engine(url)
        yield url, engine, make_session_factory(engine)
        engine.dispose()
