"""The GPU profile on a host without NVIDIA: the file resolves, and `up` fails with the message
docs/docker.md quotes, the Docker daemon's own, naming the missing `nvidia` device driver.

The image is the one thing swapped (an override file gives the GPU worker tokenloom:cpu): building
tokenloom:cuda here would download gigabytes of CUDA wheels to reach an error that the daemon
raises from the service's device reservation alone, before any image code runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.compose.compose_project import REPO_ROOT, ComposeProject
from tests.compose.docker_engine import DockerEngine
from tests.compose.project_image import CPU_IMAGE

NO_NVIDIA_ERROR = 'could not select device driver "nvidia" with capabilities: [[gpu]]'


@pytest.fixture(scope="module")
def gpu_project(
    engine: DockerEngine, images: dict[str, float], tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[ComposeProject]:
    runtimes = engine.docker("info", "--format", "{{json .Runtimes}}").stdout
    if "nvidia" in runtimes:
        pytest.skip("this host has the NVIDIA container runtime: the no-GPU error cannot show here")
    override = tmp_path_factory.mktemp("gpu-override") / "no-cuda-build.yml"
    override.write_text(yaml.safe_dump({"services": {"worker": {"image": CPU_IMAGE}}}))
    project = ComposeProject(
        engine,
        "tokenloom-compose-test-gpu",
        {"MODELS_DIR": str(models_dir)},
        (REPO_ROOT / "docker-compose.yml", override),
    )
    try:
        yield project
    finally:
        project.down()


def test_the_gpu_profile_resolves(engine: DockerEngine):
    plain = ComposeProject(engine, "tokenloom-compose-test-gpu")
    services = yaml.safe_load(plain.compose("--profile", "gpu", "config").stdout)["services"]
    assert services["worker"]["image"] == "tokenloom:cuda" and "worker-cpu" not in services


def test_up_on_a_host_without_nvidia_fails_with_the_documented_error(gpu_project: ComposeProject):
    done = gpu_project.compose("--profile", "gpu", "up", "--detach", "--no-deps", "worker", check=False)
    assert done.returncode != 0, done.stdout
    assert NO_NVIDIA_ERROR in done.stderr, done.stderr
    assert NO_NVIDIA_ERROR in (REPO_ROOT / "docs" / "docker.md").read_text()
