"""The project's Dockerfile, built on the private engine: tokenloom:cpu, the image the compose
file's API, migration and CPU worker run, and the shared `base` stage, where the CUDA variant's
install is resolved (test_cuda_variant.py).

BuildKit builds only the stages a target needs, so building tokenloom:cpu never starts the
install-cuda stage and its gigabytes of CUDA wheels. Layers are cached in the engine's data root:
a warm run with unchanged sources rebuilds nothing.
"""

from __future__ import annotations

from tests.compose.compose_project import REPO_ROOT
from tests.compose.docker_engine import DockerEngine
from tests.compose.torch_wheel_index import cpu_torch_index

CPU_IMAGE = "tokenloom:cpu"
BUILD_TIMEOUT_S = 1800  # cold: ~2.5 min of pip install and ~2.5 min of kernel build on 2 cores


def build_cpu_image(engine: DockerEngine) -> None:
    """`docker build -t tokenloom:cpu --build-arg TORCH_VARIANT=cpu .`, as the compose file builds
    it, plus TORCH_CPU_INDEX where PyTorch's index is out of reach (torch_wheel_index.py)."""
    args = ["build", "--tag", CPU_IMAGE, "--build-arg", "TORCH_VARIANT=cpu"]
    with cpu_torch_index(REPO_ROOT / "requirements" / "cpu.lock") as local_index:
        if local_index is not None:
            # The local index listens on the host's 127.0.0.1, the one plain-HTTP origin pip trusts.
            args += ["--build-arg", f"TORCH_CPU_INDEX={local_index}", "--network", "host"]
        engine.docker(*args, str(REPO_ROOT), timeout_s=BUILD_TIMEOUT_S)


def build_base_stage(engine: DockerEngine) -> str:
    """The image id of the Dockerfile's `base` stage: Python, g++ and the sources, nothing installed."""
    done = engine.docker("build", "--quiet", "--target", "base", str(REPO_ROOT), timeout_s=BUILD_TIMEOUT_S)
    return done.stdout.strip()


def image_size_mb(engine: DockerEngine, image: str) -> float:
    return int(engine.docker("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6
