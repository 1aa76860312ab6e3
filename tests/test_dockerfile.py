"""The Dockerfile's two torch variants install from the right places: PyPI's CUDA torch for the
cuda image (the build fails without it), PyTorch's CPU wheel index for the cpu image only.

Why it matters: on that index `torch==2.13.0+cpu` satisfies cuda.lock's `torch==2.13.0` and sorts
above PyPI's CUDA wheel, so any CUDA install that can see the index gets CPU torch. The Dockerfile
is parsed here (stages, continuation lines joined, comments dropped); no container engine needed.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "download.pytorch.org/whl/cpu"
PIP_SOURCE_FLAGS = ("--extra-index-url", "--index-url", " -i ", "--find-links", " -f ")
PIP_SOURCE_VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS")


@dataclass
class Stage:
    base: str  # the FROM image or stage
    name: str | None  # FROM ... AS name
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (keyword, arguments)

    def runs(self) -> list[str]:
        return [arguments for keyword, arguments in self.instructions if keyword == "RUN"]


def parse_dockerfile(text: str) -> tuple[list[str], dict[str | None, Stage]]:
    """(the ARGs before the first FROM, the stages by name; the last one also under None)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", "")  # the default escape character continues a line
    global_args: list[str] = []
    stages: list[Stage] = []
    for line in filter(str.strip, joined.splitlines()):
        keyword, _, arguments = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = arguments.partition(" AS ")
            stages.append(Stage(base.strip(), name.strip() or None))
        elif stages:
            stages[-1].instructions.append((keyword, arguments.strip()))
        elif keyword == "ARG":
            global_args.append(arguments.strip())
    by_name: dict[str | None, Stage] = {s.name: s for s in stages if s.name}
    by_name[None] = stages[-1]
    return global_args, by_name


def pip_installs(stage: Stage) -> list[str]:
    """Each `pip install` command of the stage's RUN instructions."""
    commands = (command.strip() for run in stage.runs() for command in run.split("&&"))
    return [command for command in commands if command.startswith(("pip install", "python -m pip install"))]


def sees_another_index(text: str) -> bool:
    return CPU_INDEX in text or any(flag in text for flag in PIP_SOURCE_FLAGS)


def dockerfile() -> tuple[list[str], dict[str | None, Stage]]:
    return parse_dockerfile((REPO_ROOT / "Dockerfile").read_text())


def test_each_variant_installs_in_its_own_stage_and_the_image_continues_from_the_chosen_one():
    global_args, stages = dockerfile()
    assert "TORCH_VARIANT=cuda" in global_args  # a plain `docker build .` is the CUDA image
    assert stages["base"].base == "python:3.11-slim"
    assert stages["install-cpu"].base == stages["install-cuda"].base == "base"
    final = stages[None]
    assert final.base == "install-${TORCH_VARIANT}"
    assert ("RUN", "tokenloom build-kernels") in final.instructions  # no first start pays for the kernel build
    assert not pip_installs(stages["base"]) and not pip_installs(final)  # nothing both variants would share
    for variant in ("cpu", "cuda"):
        assert (REPO_ROOT / "requirements" / f"{variant}.lock").is_file()


def test_the_cpu_index_is_seen_only_by_the_cpu_install():
    global_args, stages = dockerfile()
    # The CPU index is a build argument of the install-cpu stage alone (a stage's ARG is invisible to
    # the others), defaulting to PyTorch's page; the compose test points it at a local copy.
    index_arg = ("ARG", f"TORCH_CPU_INDEX=https://{CPU_INDEX}")
    assert index_arg in stages["install-cpu"].instructions
    assert not any("TORCH_CPU_INDEX" in arg for arg in global_args)
    [cpu_install] = pip_installs(stages["install-cpu"])
    assert "--extra-index-url ${TORCH_CPU_INDEX}" in cpu_install and "-c requirements/cpu.lock" in cpu_install
    [cuda_install] = pip_installs(stages["install-cuda"])
    assert "-c requirements/cuda.lock" in cuda_install and not sees_another_index(cuda_install)
    # Nowhere else: no other install names an index, no stage sets pip's index variables.
    for name, stage in stages.items():
        for keyword, arguments in stage.instructions:
            if (name, keyword, arguments) not in (("install-cpu", "RUN", cpu_install), ("install-cpu", *index_arg)):
                assert CPU_INDEX not in arguments and "TORCH_CPU_INDEX" not in arguments, (name, keyword, arguments)
            if keyword in ("ENV", "ARG"):
                assert not any(v in arguments for v in PIP_SOURCE_VARIABLES), (name, keyword, arguments)
        others = [c for c in pip_installs(stage) if c != cpu_install]
        assert not any(sees_another_index(c) for c in others), (name, others)


def test_the_cuda_build_fails_on_a_torch_without_cuda():
    """The check that follows the CUDA install, run here against this environment's torch."""
    _, stages = dockerfile()
    [run] = stages["install-cuda"].runs()
    install, check = (command.strip() for command in run.split("&&"))
    assert install.startswith("pip install") and "torch.version.cuda" in check
    assert check.startswith("python -c ")
    done = subprocess.run(
        ["bash", "-c", f"{shlex.quote(sys.executable)} {check.removeprefix('python ')}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if torch.version.cuda:
        assert done.returncode == 0, done.stderr
    else:  # CI's CPU torch: exactly what a CUDA image that saw the CPU index would have got
        assert done.returncode != 0 and "torch.version.cuda is None" in done.stderr, done.stderr


def test_the_image_copies_every_package_folder_the_install_maps():
    """`pip install .` in the image needs every folder pyproject.toml maps to a tokenloom package."""
    package_dirs = set(
        tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    _, stages = dockerfile()
    copied = {
        source
        for stage in stages.values()
        for keyword, arguments in stage.instructions
        if keyword == "COPY" and len(parts := arguments.split()) == 2 and (source := parts[0]) == parts[1]
    }
    assert package_dirs <= copied, f"the Dockerfile copies none of {sorted(package_dirs - copied)}"
