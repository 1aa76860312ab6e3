"""docker-compose.yml, as `docker-compose config` resolves it, agrees with config.toml, the CLI and
the README: services, commands, ports, health checks, dependencies and TOKENLOOM_* variable names.

`docker-compose` (the Debian package; .ci/run installs it) must be present: without it this test
FAILS, it never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from engine.config import load_config
from tests.worker.conftest import REPO_ROOT

CPU_COMMAND = "TOKENLOOM_TORCH_VARIANT=cpu docker compose --profile cpu up --scale worker=0"


def compose_config(**env) -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `apt-get install -y docker-compose` (.ci/run does it)",
                    pytrace=False)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    done = subprocess.run([binary, "-f", "docker-compose.yml", "config"], cwd=REPO_ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
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
    assert [p.split("/")[0].rsplit(":", 1)[-1] for p in services["api"]["ports"]] == [str(port)]
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
        assert any(v.startswith("models:/models") for v in services[name]["volumes"])
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


def test_readme_documents_the_compose_file(compose):
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("### docker compose"):readme.index("### Metrics and stats")]
    assert "docker compose up" in section and CPU_COMMAND in section
    assert CPU_COMMAND in (REPO_ROOT / "docker-compose.yml").read_text()
    compose_env = set(compose["services"]["api"]["environment"]) | set(compose["services"]["worker"]["environment"])
    named = {n for n in re.findall(r"TOKENLOOM_[A-Z_]*[A-Z]", section)} - {"TOKENLOOM_TORCH_VARIANT"}  # build arg
    assert named and named <= compose_env, named - compose_env
    for service in ("postgres", "redis", "migrate", "api", "worker"):
        assert f"`{service}`" in section or service.capitalize() in section
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("# ") and "FROM python:3.11-slim" in dockerfile
    assert "ARG TORCH_VARIANT" in dockerfile and "download.pytorch.org/whl/${TORCH_VARIANT}" in dockerfile
