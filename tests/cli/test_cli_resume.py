"""`tokenloom run` is resumable: SIGKILL it part way, run it again, get the complete file.

Real subprocesses on a tiny random Llama, the default SQLite ledger (./tokenloom.db in the cwd).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[2]
NUM_LINES = 48
RESUMED = re.compile(r"resumed: (\d+) lines? reused from an earlier run, (\d+) generated; wrote (\d+) result lines")


def env_for(checkpoint: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env.update(
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TOKENLOOM_MODEL_NAME=str(checkpoint),
        TOKENLOOM_MODEL_MAX_MODEL_LEN="128",
        TOKENLOOM_SCHEDULER_MAX_NUM_SEQS="4",
        **extra,
    )
    return env


def command(src: Path, dst: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tokenloom.cli", "run", str(src), "-o", str(dst), "--no-progress", *flags]


def cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# The run that gets killed stalls every line (engine/testing/fault_injection.py): at most one token per
# STALL_STEP_S, so its 48 lines of 32 tokens on 4 slots take >= 12 * 32 * STALL_STEP_S = 19 s on
# any CPU, and the kill (sent once 5 lines are written) lands part way. The other runs go full speed.
STALL_MARKER = "~STALL~"
STALLED = {"TOKENLOOM_FAULT_INJECT_PROMPT": f"stall:{STALL_MARKER}"}


def write_input(path: Path) -> Path:
    lines = [
        {
            "custom_id": f"c{i}",
            "prompt": f"{STALL_MARKER} Line {i} of the story",
            "max_tokens": 32,
            "ignore_eos": True,
            "temperature": 0,
        }
        for i in range(NUM_LINES)
    ]
    lines[7] = {"custom_id": "bad", "prompt": "x", "temperature": -1}  # a failed line is resumed too
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return path


def complete_lines(path: Path) -> list[dict]:
    """The whole lines of a file a killed process wrote (its last line may be cut short)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(l) for l in text.split("\n")[:-1]]


def kill_after_lines(args: list[str], cwd: Path, env: dict[str, str], dst: Path, min_lines: int) -> list[dict]:
    """Start the run, SIGKILL it once `dst` holds `min_lines` lines; return those lines."""
    log = cwd / "killed.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while len(complete_lines(dst)) < min_lines:
            assert proc.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no {min_lines} lines after 180 s:\n{log.read_text()[-2000:]}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return complete_lines(dst)


def test_a_killed_run_resumes_to_the_same_results(llama_checkpoint, tmp_path):
    src = write_input(tmp_path / "in.jsonl")
    env = env_for(llama_checkpoint)
    clean_dir, run_dir = tmp_path / "clean", tmp_path / "run"
    clean_dir.mkdir(), run_dir.mkdir()

    clean = cli(command(src, clean_dir / "out.jsonl"), clean_dir, env)
    assert clean.returncode == 0, clean.stderr
    expected = complete_lines(clean_dir / "out.jsonl")
    assert len(expected) == NUM_LINES and "resumed" not in clean.stderr

    dst = run_dir / "out.jsonl"
    partial = kill_after_lines(command(src, dst), run_dir, {**env, **STALLED}, dst, min_lines=5)
    assert 5 <= len(partial) < NUM_LINES, "the run finished before the kill: make it longer"
    assert (run_dir / "tokenloom.db").is_file()

    again = cli(command(src, dst), run_dir, env)
    assert again.returncode == 0, again.stderr
    results = complete_lines(dst)
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in expected]  # complete, in order
    assert len({r["custom_id"] for r in results}) == NUM_LINES  # no duplicates
    assert [r["line"] for r in results] == list(range(1, NUM_LINES + 1))
    for got, want in zip(results, expected):
        assert (got["status"], got["text"], got["token_ids"]) == (want["status"], want["text"], want["token_ids"])
    assert results[: len(partial)] == partial  # written before the kill: re-emitted verbatim

    found = RESUMED.search(again.stderr)
    assert found, again.stderr[-2000:]
    reused, generated, total = map(int, found.groups())
    assert reused >= len(partial) and generated == total - reused and total == NUM_LINES
    assert generated > 0, "everything was reused: the kill came too late to test a resume"
    assert "| resumed" in again.stderr  # and in the closing summary table


def test_fresh_reruns_everything(llama_checkpoint, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"f{i}", "prompt": "Hi", "max_tokens": 2, "temperature": 0}) + "\n"
            for i in range(3)
        )
    )
    env, dst = env_for(llama_checkpoint), tmp_path / "out.jsonl"
    assert cli(command(src, dst, "--quiet"), tmp_path, env).returncode == 0
    # Without --fresh this attempt would report "resumed: 3 lines reused" (see the test above).
    fresh = cli(command(src, dst, "--quiet", "--fresh"), tmp_path, env)
    assert fresh.returncode == 0, fresh.stderr
    assert "resumed" not in fresh.stderr
    assert fresh.stderr.strip().splitlines()[-1] == f"wrote 3 result lines to {dst}"
    assert len(complete_lines(dst)) == 3


def test_an_unopenable_database_exits_2_naming_the_setting(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hi"}\n')
    env = env_for(tmp_path / "no-model", TOKENLOOM_DATABASE_URL=f"sqlite:///{tmp_path / 'missing' / 'x.db'}")
    proc = cli(command(src, tmp_path / "out.jsonl"), tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    assert "[database] url" in proc.stderr and "TOKENLOOM_DATABASE_URL" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_describes_resuming_and_fresh(tmp_path):
    proc = cli([sys.executable, "-m", "tokenloom.cli", "run", "--help"], tmp_path, env_for(tmp_path))
    assert proc.returncode == 0 and "--fresh" in proc.stdout and "Resumable" in proc.stdout
