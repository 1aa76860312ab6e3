"""The core install runs `tokenloom run`; the queue, API, quantization and sweep packages are extras
(pyproject.toml). Without them, `run` still works, and a command that needs one exits 2 naming the
extra to install, never with a traceback. The packages are hidden from a subprocess by an import
hook that answers like a missing package does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parent.parent
EXTRAS_ONLY = [
    "celery",
    "kombu",
    "redis",
    "psycopg",
    "tenacity",
    "fastapi",
    "starlette",
    "uvicorn",
    "multipart",
    "prometheus_client",
    "bitsandbytes",
    "matplotlib",
]

WITHOUT_EXTRAS = textwrap.dedent(f"""
    import importlib.abc, sys
    HIDDEN = {EXTRAS_ONLY!r}
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Hide())
    from tokenloom.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def tokenloom_without_extras(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env["TOKENLOOM_DATABASE_URL"] = f"sqlite:///{cwd / 'ledger.db'}"
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_run_needs_only_the_core(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}) + "\n")
    done = tokenloom_without_extras("run", str(source), "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "in.results.jsonl").read_text())["status"] == "succeeded"


def test_a_command_needing_an_extra_names_it(tmp_path):
    for command in (["worker"], ["serve"]):
        done = tokenloom_without_extras(*command, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stderr[-3000:])
        assert "pip install 'tokenloom[" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
