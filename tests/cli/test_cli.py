"""`python -m tokenloom.cli.main` end to end, in a subprocess, on a tiny random checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


def cli(args, cwd, **env_vars):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def model_env(checkpoint):
    return {
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": "128",
        "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS": "4",
    }


def write_input(tmp_path):
    lines = [
        {"custom_id": "a", "prompt": "Hello", "max_tokens": 3, "temperature": 0},
        {"custom_id": "b", "prompt": "Hi", "temperature": 5000},
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Hey"}], "max_completion_tokens": 2},
        },
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    return path


def test_run_writes_results_next_to_input(checkpoint, tmp_path):
    src = write_input(tmp_path)
    proc = cli(["run", str(src), "--no-progress"], tmp_path, **model_env(checkpoint))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "batch.results.jsonl"
    results = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["custom_id"], r["status"]) for r in results] == [("a", "succeeded"), ("b", "failed"), ("c", "succeeded")]
    assert len(results[0]["token_ids"]) == 3 and results[0]["model"] == str(checkpoint)
    assert "temperature" in results[1]["error"]["message"]
    assert "KV cache" in proc.stderr  # the engine's start-up report
    assert "TTFT" in proc.stderr and "1 failed" in proc.stderr and str(out) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_quiet_with_output_path(checkpoint, tmp_path):
    src = write_input(tmp_path)
    out = tmp_path / "elsewhere.jsonl"
    proc = cli(["run", str(src), "-o", str(out), "--quiet"], tmp_path, **model_env(checkpoint))
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 3
    assert "KV cache" not in proc.stderr and "TTFT" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(str(out))


def test_missing_input_exits_2(tmp_path):
    proc = cli(["run", str(tmp_path / "nope.jsonl")], tmp_path)
    assert proc.returncode == 2
    assert "error: input file not found" in proc.stderr and "nope.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_env_exits_2_naming_the_key(tmp_path):
    src = write_input(tmp_path)
    proc = cli(["run", str(src)], tmp_path, TOKENLOOM_SCHEDULER_MAX_NUM_SEQS="-1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "scheduler.max_num_seqs" in proc.stderr
    assert "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_config_file_exits_2(tmp_path):
    src = write_input(tmp_path)
    (tmp_path / "config.toml").write_text("[kv_cache]\nblock_size = 0\n")  # picked up from the cwd
    proc = cli(["run", str(src)], tmp_path)
    assert proc.returncode == 2 and "kv_cache.block_size" in proc.stderr


def test_model_load_error_exits_2_without_traceback(tmp_path):
    src = write_input(tmp_path)
    proc = cli(["run", str(src)], tmp_path, TOKENLOOM_MODEL_NAME=str(tmp_path))  # no config.json there
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in proc.stderr


def test_help(tmp_path):
    proc = cli(["--help"], tmp_path)
    assert proc.returncode == 0 and "run" in proc.stdout and "examples" in proc.stdout
    proc = cli(["run", "--help"], tmp_path)
    assert proc.returncode == 0 and "INPUT" in proc.stdout and "--config" in proc.stdout


def test_run_without_a_configured_model_builds_and_uses_the_random_demo_model(tmp_path):
    """[model] demo = "random" pins the demo model that needs no download (the trained one:
    tests/engine/models/test_demo_choice.py)."""
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}) + "\n")
    proc = cli(
        ["run", str(src), "--no-progress"],
        tmp_path,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        TOKENLOOM_MODEL_DEMO="random",
    )
    assert proc.returncode == 0, proc.stderr
    assert "demo model" in proc.stderr and "gibberish" in proc.stderr
    result = json.loads((tmp_path / "p.results.jsonl").read_text())
    assert result["status"] == "succeeded" and len(result["token_ids"]) == 5
    assert (tmp_path / "cache" / "tokenloom" / "tokenloom-demo-llama" / "config.json").is_file()


def test_run_takes_the_model_and_engine_flags_of_vllm_serve(checkpoint, tmp_path):
    """--model etc. set the same keys as TOKENLOOM_MODEL_* (no env var given here)."""
    src = write_input(tmp_path)
    proc = cli(
        [
            "run",
            str(src),
            "--no-progress",
            "--model",
            str(checkpoint),
            "--max-model-len",
            "128",
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ],
        tmp_path,
        TOKENLOOM_SCHEDULER_MAX_NUM_SEQS="4",
    )
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(l) for l in (tmp_path / "batch.results.jsonl").read_text().splitlines()]
    assert {r["model"] for r in results if r["status"] == "succeeded"} == {str(checkpoint)}
    assert "Traceback" not in proc.stderr


def test_run_writes_openai_batch_output_lines(checkpoint, tmp_path):
    """--output-format openai: the lines /v1/batches writes, so a file moves between the two."""
    src = write_input(tmp_path)
    out = tmp_path / "openai.jsonl"
    proc = cli(
        [
            "run",
            str(src),
            "-o",
            str(out),
            "--quiet",
            "--output-format",
            "openai",
            "--model",
            str(checkpoint),
            "--max-model-len",
            "128",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(l["custom_id"], l["response"]["status_code"]) for l in lines] == [("a", 200), ("b", 400), ("c", 200)]
    assert all(l["id"].startswith("batch_req_") and l["error"] is None for l in lines)
    assert lines[0]["response"]["body"]["object"] == "text_completion"
    assert lines[2]["response"]["body"]["object"] == "chat.completion"
    assert "temperature" in lines[1]["response"]["body"]["error"]["message"]
