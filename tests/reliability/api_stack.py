"""One API + worker stack shared by the API-side reliability tests (faults, hostile input, load):
`tokenloom serve` and `tokenloom worker` as real processes (their logs are files the key-leak
check greps), a private Redis, a fresh Postgres database, and project keys.

Shared for the whole session (imported by conftest.py) because starting a worker and an API costs
~25 s on a small machine. The API reaches Postgres through a TcpProxy (tests/reliability/
tcp_proxy.py) so a test can cut it; the worker talks to Postgres directly.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.reliability.api_process import ApiProcess
from tests.reliability.conftest import RedisServer, _free_port, stalling, worker_settings
from tests.reliability.tcp_proxy import TcpProxy
from tests.services import WorkerProcess, fresh_pg_database, start_worker
from tokenloom.store import migrate
from tokenloom.store.api_keys.key_queries import create_key
from tokenloom.store.database import make_session_factory, make_sql_engine

MAX_NUM_SEQS = 4
MAX_BODY_MB = 1
MAX_FILE_MB = 8
MAX_BATCH_LINES = 50


@dataclass
class ApiStack:
    api: ApiProcess
    worker: WorkerProcess
    proxy: TcpProxy
    checkpoint: Path
    sessions: object  # direct to Postgres (not through the proxy)
    admin_key: str
    redis: RedisServer  # private: a test may restart it
    keys: dict[str, str] = field(default_factory=dict)  # project -> key

    @property
    def model(self) -> str:
        return str(self.checkpoint)

    @property
    def secrets(self) -> list[str]:
        return [self.admin_key, *self.keys.values()]

    def client(self, key: str | None = "admin", **kwargs) -> httpx.Client:
        token = self.admin_key if key == "admin" else key
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.api.base_url, headers=headers, timeout=60, **kwargs)


@pytest.fixture(scope="session")
def api_stack(fault_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-stack")
    redis_server = RedisServer(_free_port(), tmp)
    redis_server.start()
    with fresh_pg_database() as db_url:
        migrate.upgrade(db_url)
        url = make_url(db_url)
        proxy = TcpProxy(url.host, url.port or 5432)
        api_db_url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        settings = worker_settings(fault_checkpoint, db_url, redis_server.url, MAX_NUM_SEQS)
        # The worker stalls prompts holding STALL_MARKER (conftest.py), for tests that must act mid-job.
        worker = start_worker(stalling(settings), 2 * MAX_NUM_SEQS, tmp / "worker.log")
        admin_key = "tl-admin-" + uuid.uuid4().hex
        api = ApiProcess(
            {
                **settings,
                "TOKENLOOM_DATABASE_URL": api_db_url,
                "TOKENLOOM_API_KEY": admin_key,
                "TOKENLOOM_SERVER_MAX_BODY_MB": str(MAX_BODY_MB),
                "TOKENLOOM_SERVER_MAX_FILE_MB": str(MAX_FILE_MB),
                "TOKENLOOM_SERVER_MAX_BATCH_LINES": str(MAX_BATCH_LINES),
            },
            _free_port(),
            tmp / "api.log",
        )
        sql = make_sql_engine(db_url)
        sessions = make_session_factory(sql)
        try:
            api.start()
            worker.wait_ready()
            stack = ApiStack(api, worker, proxy, fault_checkpoint, sessions, admin_key, redis_server)
            stack.keys = {project: create_key(sessions, project)[0] for project in ("lab-a", "lab-b")}
            yield stack
        finally:
            api.stop()
            worker.stop()
            proxy.close()
            sql.dispose()
            redis_server.stop()
