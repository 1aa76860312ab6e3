"""The two images get the torch their hosts need: tokenloom:cpu (built) has CPU torch, and the
cuda variant's install, resolved in the Dockerfile's own `base` stage, picks PyPI's CUDA build.

Why not build tokenloom:cuda here: its CUDA wheels are gigabytes, downloaded for a check and again
for every cold cache, on a machine with no GPU to run them. What could go wrong in that stage is
which torch pip picks (a CPU index in sight makes it `+cpu`, tests/test_dockerfile.py), and that is
decided by resolution: the probe (cuda_torch_probe.py) runs the stage's exact pip command as a dry
run in the stage's parent image, then reads `cuda` out of the chosen wheel's torch/version.py by
HTTP range requests, the value `torch.version.cuda` returns once it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compose.docker_engine import DockerEngine
from tests.compose.phase_clock import PhaseClock
from tests.compose.project_image import CPU_IMAGE, build_base_stage
from tests.test_dockerfile import dockerfile, pip_installs

PROBE = Path(__file__).resolve().parent / "cuda_torch_probe.py"


@pytest.fixture(scope="module")
def cuda_resolution(engine: DockerEngine, images: dict[str, float], phases: PhaseClock) -> dict:
    _, stages = dockerfile()
    [install] = pip_installs(stages["install-cuda"])
    with phases.phase("cuda variant: base stage + resolution of its install"):
        base = build_base_stage(engine)
        done = engine.docker(
            "run", "--rm", "--volume", f"{PROBE}:/probe.py:ro", base, "python", "/probe.py", install, timeout_s=900
        )
    resolution = json.loads(done.stdout.strip().splitlines()[-1])
    phases.write(
        f"[compose images] the cuda variant would download {resolution['download_mb']} MB of wheels "
        f"({resolution['num_packages']} packages, torch {resolution['torch_version_py']['__version__']})"
    )
    return resolution


def test_the_cuda_variant_installs_a_cuda_build_of_torch_from_pypi(cuda_resolution: dict):
    assert cuda_resolution["torch_url"].startswith("https://files.pythonhosted.org/"), cuda_resolution
    assert "+cpu" not in cuda_resolution["torch_version"]
    assert cuda_resolution["torch_version_py"]["cuda"], cuda_resolution  # torch.version.cuda once installed
    assert cuda_resolution["nvidia_requirements"], "a CUDA torch pulls in NVIDIA's runtime wheels"


def test_the_cpu_image_has_cpu_torch_and_no_cuda_libraries(engine: DockerEngine, images: dict[str, float]):
    done = engine.docker(
        "run",
        "--rm",
        CPU_IMAGE,
        "python",
        "-c",
        "import json, torch, importlib.metadata as m; print(json.dumps([torch.__version__, "
        "torch.version.cuda, [d.name for d in m.distributions() if d.name.startswith('nvidia')]]))",
    )
    version, cuda, nvidia = json.loads(done.stdout.strip().splitlines()[-1])
    assert version.endswith("+cpu") and cuda is None and nvidia == []
