"""A wheel install works away from the source tree: it holds tokenloom.* only (no top-level
`engine`, `worker` or `api`), its migrations are package data (`tokenloom db upgrade` against a real
Postgres), and `tokenloom run` processes a file. The venv sees the dependencies of the environment running the
tests (a virtualenv or not) but its own tokenloom, which the test checks it imports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.overlay_venv import see_this_environments_packages
from tests.services import fresh_pg_database

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wheel")
    # Build from a copy of what git would commit: an in-tree build/ left by an earlier build can
    # carry deleted files into the wheel, and the checkout stays untouched.
    source = root / "source"
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (root / "dist").glob("tokenloom-*.whl")
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    see_this_environments_packages(python)
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return wheel, root / "venv"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_") and k != "PYTHONPATH"}
    return {**env, **extra}


def test_the_wheel_holds_the_tokenloom_namespace_only(wheel_venv):
    wheel, _ = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("tokenloom-")}
    assert top == {"tokenloom"}, top
    assert "tokenloom/__init__.py" not in names  # a namespace package over the separate folders
    for expected in (
        "tokenloom/engine/loop/engine.py",
        "tokenloom/store/models.py",
        "tokenloom/cli/main.py",
        "tokenloom/migrations/env.py",
        "tokenloom/migrations/script.py.mako",
        "tokenloom/migrations/versions/0001_initial.py",
        "tokenloom/engine/cpu/csrc/decoder_stack.cpp",
    ):
        assert expected in names, expected


def test_imports_resolve_to_the_wheel_and_engine_is_not_a_top_level_name(wheel_venv, tmp_path):
    _, env_dir = wheel_venv
    python = str(env_dir / "bin" / "python")
    done = subprocess.run(
        [
            python,
            "-c",
            "import tokenloom.engine, tokenloom.store.migrate as m; "
            "print(tokenloom.engine.__file__); print(m.MIGRATIONS_DIR)",
        ],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    engine_file, migrations_dir = done.stdout.split()
    assert engine_file.startswith(str(env_dir)) and migrations_dir.startswith(str(env_dir))
    for name in ("engine", "worker", "api"):
        refused = subprocess.run(
            [python, "-c", f"import {name}"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0 and "ModuleNotFoundError" in refused.stderr, name


def test_db_upgrade_and_run_from_the_wheel(wheel_venv, tmp_path):
    _, env_dir = wheel_venv
    tokenloom = str(env_dir / "bin" / "tokenloom")
    with fresh_pg_database() as url:
        done = subprocess.run(
            [tokenloom, "db", "upgrade"],
            cwd=tmp_path,
            env=clean_env(TOKENLOOM_DATABASE_URL=url),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    source = tmp_path / "prompts.jsonl"
    source.write_text(
        json.dumps({"custom_id": "a", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}) + "\n"
    )
    env = clean_env(TOKENLOOM_DATABASE_URL=f"sqlite:///{tmp_path / 'ledger.db'}")
    done = subprocess.run(
        [tokenloom, "run", str(source), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = (tmp_path / "prompts.results.jsonl").read_text().splitlines()
    result = json.loads(line)
    assert result["custom_id"] == "a" and result["status"] == "succeeded" and len(result["token_ids"]) == 4
