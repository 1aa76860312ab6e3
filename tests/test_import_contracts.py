"""Imports point one way: cli -> api | worker -> store -> settings | offline -> openai_protocol ->
engine, and the engine imports nothing of ours; inside the engine, its parts are layered (loop,
runner, core, kernels and models, config) and every part is in that contract, the core loop
imports no torch, generic engine modules reach the CPU backend only through tokenloom.engine.cpu,
everything above the engine uses its public surface, and no route imports another. import-linter checks the contracts in
pyproject.toml over the installed tokenloom.* packages; deliberately wrong contracts prove the
checker sees the real imports."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lint_imports(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    binary = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run([binary, "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_layer_contract_holds():
    done = lint_imports()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in done.stdout


def test_an_upside_down_contract_is_reported_broken(tmp_path):
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\n"
        "root_packages =\n    tokenloom.engine\n    tokenloom.cli\n"
        "[importlinter:contract:upside-down]\n"
        "name = upside down\ntype = layers\nlayers =\n    tokenloom.engine\n    tokenloom.cli\n"
    )
    done = lint_imports("--config", str(tmp_path / ".importlinter"), cwd=tmp_path)
    assert done.returncode == 1
    assert "tokenloom.cli is not allowed to import tokenloom.engine" in done.stdout


def test_a_torch_import_where_a_contract_forbids_it_is_reported(tmp_path):
    """The core's no-torch contract works on an external package: the same rule on the runner,
    which does import torch, is reported with the importing module."""
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\n"
        "root_packages =\n    tokenloom.engine\n"
        "include_external_packages = true\n"
        "[importlinter:contract:runner-without-torch]\n"
        "name = runner without torch\ntype = forbidden\n"
        "source_modules =\n    tokenloom.engine.runner\nforbidden_modules =\n    torch\n"
    )
    done = lint_imports("--config", str(tmp_path / ".importlinter"), cwd=tmp_path)
    assert done.returncode == 1
    assert "tokenloom.engine.runner is not allowed to import torch" in done.stdout
    assert "tokenloom.engine.runner.device -> torch" in done.stdout


def test_the_engine_imported_by_a_layer_below_it_is_reported(tmp_path):
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\n"
        "root_packages =\n    tokenloom.engine\n    tokenloom.openai_protocol\n"
        "[importlinter:contract:wire-format-below-engine]\n"
        "name = wire format below the engine\ntype = layers\n"
        "layers =\n    tokenloom.engine\n    tokenloom.openai_protocol\n"
    )
    done = lint_imports("--config", str(tmp_path / ".importlinter"), cwd=tmp_path)
    assert done.returncode == 1
    assert "tokenloom.openai_protocol is not allowed to import tokenloom.engine" in done.stdout


def test_every_engine_part_is_in_the_parts_contract():
    """A module or folder added at the engine's root must be placed in the layers, or nothing
    checks what it imports."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    parts_contract = next(
        c for c in config["tool"]["importlinter"]["contracts"] if c.get("containers") == ["tokenloom.engine"]
    )
    layered = {name.strip() for layer in parts_contract["layers"] for name in re.split(r"[:|]", layer)}
    engine_root = REPO / "engine"
    parts = {p.stem for p in engine_root.glob("*.py") if p.name != "__init__.py"}
    parts |= {p.name for p in engine_root.iterdir() if (p / "__init__.py").is_file()}
    assert parts, "no engine parts found"
    assert parts <= layered, f"engine parts in no layer of the contract: {sorted(parts - layered)}"
