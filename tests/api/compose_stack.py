"""docker-compose.yml's services run as local processes: no container engine runs here, so the
compose smoke test, the Prometheus scrape test and the dashboard test run each service's own
`command` with that service's own `environment` (as Docker Compose v2 resolves the file) against
the local Postgres and a private redis-server.

What differs from a container is only what a container would provide: the service hostnames
`postgres` and `redis` become local addresses (TOKENLOOM_DATABASE_URL names a fresh database
with this machine's credentials, TOKENLOOM_QUEUE_BROKER_URL the private Redis) and the API's
`--host 0.0.0.0 --port 8000` becomes a free loopback port. Every other variable and argument
is the file's, so a wrong command or variable there fails here.

One stack per test session (the `compose_stack` fixture of tests/api/conftest.py): the three test modules use the same one,
and pytest's session end stops it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.api.test_docker_compose import compose_config
from tests.conftest import ORACLE_CONFIG
from tests.services import REPO_ROOT, fresh_pg_database
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

START_TIMEOUT_S = 180  # a bound for a broken start (model load, Celery), not a measure of speed
API_KEY = "tl-compose-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2, log=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{log()[-3000:]}")
        time.sleep(poll_s)
    return value


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=self.log_path.parent, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def run(self, argv: list[str] | None = None, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        """A one-shot command (the migration, a healthcheck) with this service's environment."""
        return subprocess.run(
            argv or self.argv, env=self.env, cwd=self.log_path.parent, capture_output=True, text=True, timeout=timeout_s
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(45)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class LocalComposeStack:
    services: dict  # the resolved compose file's services
    migrate: ServiceProcess
    api: ServiceProcess
    worker: ServiceProcess
    api_port: int
    model: str
    api_key: str = API_KEY
    host_rewrites: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=30)

    def healthcheck(self, service: str) -> subprocess.CompletedProcess:
        """The service's compose healthcheck (["CMD", argv...]) run with its environment."""
        test = self.services[service]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        process = {"api": self.api, "worker-cpu": self.worker}[service]
        return process.run([part.replace(":8000/", f":{self.api_port}/") for part in test[1:]], timeout_s=30)


def service_env(service: dict, rewrites: dict[str, str]) -> dict[str, str]:
    """The process environment of a compose service: the machine's PATH and friends, no stray
    TOKENLOOM_* variable of this shell, the service's own variables, then the host rewrites."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_") and k != "HF_TOKEN"}
    env = {name: "" if value is None else str(value) for name, value in service["environment"].items()}
    missing = set(rewrites) - set(env)
    assert not missing, f"compose service lacks {missing}"
    return {**base, "HF_HUB_OFFLINE": "1", **env, **rewrites}


@contextmanager
def private_redis(workdir: Path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is required (Debian package redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: (
                subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() == b"PONG"
            ),
            10,
            "redis-server",
        )
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


@contextmanager
def local_compose_stack(workdir: Path):
    if shutil.which("tokenloom") is None:
        pytest.fail("the `tokenloom` command is not on PATH: `pip install -e '.[test]'`")
    # A unique checkpoint directory: queues are named after the model (store/celery_app.py).
    checkpoint = build_random_checkpoint(workdir / f"compose-llama-{uuid.uuid4().hex[:8]}", seed=0, **ORACLE_CONFIG)
    services = compose_config(
        TOKENLOOM_MODEL_NAME=str(checkpoint), TOKENLOOM_MODEL_MAX_MODEL_LEN="256", TOKENLOOM_API_KEY=API_KEY
    )["services"]
    with ExitStack() as stack:
        db_url = stack.enter_context(fresh_pg_database())
        broker_url = stack.enter_context(private_redis(workdir))
        rewrites = {"TOKENLOOM_DATABASE_URL": db_url, "TOKENLOOM_QUEUE_BROKER_URL": broker_url}
        port = free_port()

        def process(name: str, argv_rewrites: dict[str, str] | None = None) -> ServiceProcess:
            argv = [(argv_rewrites or {}).get(part, part) for part in services[name]["command"]]
            return ServiceProcess(name, argv, service_env(services[name], rewrites), workdir / f"{name}.log")

        migrate = process("migrate")
        api = process("api", {"0.0.0.0": "127.0.0.1", "8000": str(port)})
        worker = process("worker-cpu")
        done = migrate.run()
        assert done.returncode == 0, f"migrate: {services['migrate']['command']}\n{done.stderr[-3000:]}"
        stack.callback(api.stop)
        api.start()
        stack.callback(worker.stop)
        worker.start()
        wait_for(
            lambda: _answers(f"http://127.0.0.1:{port}/healthz") or api.process.poll() is not None,
            START_TIMEOUT_S,
            "the api service's /healthz",
            log=api.log,
        )
        assert api.process.poll() is None, api.log()[-3000:]
        yield LocalComposeStack(services, migrate, api, worker, port, str(checkpoint), host_rewrites=rewrites)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
