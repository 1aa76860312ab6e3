"""Real services for the tests that need them: a throwaway Postgres database per test (or module),
a throwaway SQLite file, and a real `tokenloom worker` process. The conftests of the store, worker,
api and reliability tiers re-export the fixtures.

Postgres is required: CI always runs one at 127.0.0.1:5432 (TOKENLOOM_TEST_POSTGRES_URL
overrides the admin URL). When it cannot be reached the Postgres tests FAIL, they never skip.
Each fresh database is `tokenloom_test_<random>`, created from the admin database and dropped
(after terminating its connections) at teardown, so concurrent test runs never share tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from tokenloom.store import migrate

ADMIN_PG_URL = os.environ.get("TOKENLOOM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """Create an empty database next to the admin one; yield its URL; drop it afterwards."""
    admin = create_engine(
        ADMIN_PG_URL, poolclass=NullPool, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 10}
    )
    name = f"tokenloom_test_{uuid.uuid4().hex[:16]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure here means no usable Postgres
        admin.dispose()
        pytest.fail(
            f"Postgres is required for these tests but {make_url(ADMIN_PG_URL).render_as_string(hide_password=True)} "
            f"could not create a database: {exc}",
            pytrace=False,
        )
    try:
        yield make_url(ADMIN_PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_empty_url() -> Iterator[str]:
    """A fresh, empty (never migrated) Postgres database for one test."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database migrated to head, shared by the tests of one module."""
    with fresh_pg_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    """A fresh, empty SQLite database file for one test."""
    return f"sqlite:///{tmp_path / 'tokenloom.db'}"


# --- a real worker process -----------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT_S = 120


@dataclass
class WorkerProcess:
    """A `tokenloom worker` subprocess; its output goes to `log_path`."""

    process: subprocess.Popen
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while "ready" not in self.log():
            if self.process.poll() is not None:
                pytest.fail(f"worker exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"worker not ready after {timeout_s}s:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_worker(settings: dict[str, str], concurrency: int, log_path: Path) -> WorkerProcess:
    """Start `tokenloom worker` with TOKENLOOM_* `settings` (not yet ready: call wait_ready)."""
    env = {**os.environ, **settings, "PYTHONPATH": str(REPO_ROOT)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.cli", "worker", "--concurrency", str(concurrency)],
            env=env,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return WorkerProcess(process, env, log_path)


@contextmanager
def running_worker(settings: dict[str, str], concurrency: int, log_path: Path):
    """`tokenloom worker` in a subprocess with TOKENLOOM_* `settings`; yields its environment
    once Celery reports ready, and stops it (SIGTERM, then SIGKILL) afterwards."""
    worker = start_worker(settings, concurrency, log_path)
    try:
        worker.wait_ready()
        yield worker.env
    finally:
        worker.stop()
