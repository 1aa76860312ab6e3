"""Imports point one way: cli -> api | worker -> store -> settings -> engine, and the engine imports
nothing of ours; generic engine modules reach the CPU backend only through tokenloom.engine.cpu. import-linter checks the contract in pyproject.toml over the installed tokenloom.*
packages; a deliberately upside-down contract proves the checker sees the real imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lint_imports(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    binary = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run([binary, "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_layer_contract_holds():
    done = lint_imports()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout  # the layers, and the CPU backend's one door


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
