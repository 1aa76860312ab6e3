"""The CLI's one error handler, its shared options and --version: every configuration,
connection and input error is one `error:` line and exit 2, whichever command hits it; --debug
shows the traceback; --log-level is accepted by every command.

Most cases call `main()` in this process against real Postgres and Redis addresses (a Python
start per case would cost more than the whole check); one case per kind of error also runs a
real `tokenloom` subprocess, whose stderr is exactly what a user sees.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.services import fresh_pg_database
from tokenloom.cli.main import build_parser, main, package_version

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[2]


def tokenloom(*args: str, cwd: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENLOOM_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def in_process(monkeypatch, capsys, tmp_path):
    """`tokenloom ARGS` as main(ARGS) here, in tmp_path, with only the given TOKENLOOM_* variables."""

    def call(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
        for name in [n for n in os.environ if n.startswith("TOKENLOOM_")]:
            monkeypatch.delenv(name)
        for name, value in env_vars.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return call


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def batch_file(tmp_path) -> Path:
    path = tmp_path / "batch.jsonl"
    path.write_text(json.dumps({"prompt": "Hello", "max_tokens": 2}) + "\n")
    return path


COMMANDS_THAT_LOAD_CONFIG = (
    ("run", "{batch}"),
    ("serve",),
    ("worker",),
    ("submit", "{batch}"),
    ("status", str(uuid.uuid4())),
    ("cancel", str(uuid.uuid4())),
    ("db", "upgrade"),
    ("db", "prune"),
    ("keys", "list"),
    ("health", "worker"),
    ("sweep", "kv_cache.block_size", "8,16"),
)


@pytest.mark.parametrize("command", COMMANDS_THAT_LOAD_CONFIG, ids=" ".join)
def test_a_bad_config_value_is_one_line_and_exit_2_for_every_command(command, batch_file, in_process):
    argv = [part.format(batch=batch_file) for part in command]
    done = in_process(*argv, TOKENLOOM_SCHEDULER_MAX_NUM_SEQS="-1")
    assert_one_line_error(done, "scheduler.max_num_seqs", "TOKENLOOM_SCHEDULER_MAX_NUM_SEQS")


def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "config.toml").write_text("[kv_cache]\nblock_size = 0\n")  # picked up from the cwd
    assert_one_line_error(tokenloom("keys", "list", cwd=tmp_path), "kv_cache.block_size", "config.toml")


def test_a_bad_engine_flag_names_the_flag(in_process):
    assert_one_line_error(in_process("serve", "--max-model-len", "-3"), "model.max_model_len", "--max-model-len")
    assert_one_line_error(
        in_process("worker", "--gpu-memory-utilization", "1.5"),
        "kv_cache.gpu_memory_utilization",
        "--gpu-memory-utilization",
    )


@pytest.mark.parametrize(
    "command",
    [("keys", "list"), ("db", "upgrade"), ("status", str(uuid.uuid4())), ("serve", "--port", "1")],
    ids=" ".join,
)
def test_an_unreachable_database_is_one_line_and_exit_2(command, in_process):
    url = f"postgresql://postgres:test@127.0.0.1:{closed_port()}/tokenloom"
    assert_one_line_error(in_process(*command, TOKENLOOM_DATABASE_URL=url), "database")


def test_a_model_that_cannot_be_loaded_is_one_line_and_exit_2(tmp_path):
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    assert_one_line_error(tokenloom("worker", "--model", str(not_a_checkpoint), cwd=tmp_path), "config.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the error cannot happen")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(batch_file, in_process):
    assert_one_line_error(in_process("run", str(batch_file), "--device", "cuda"), "no CUDA device is visible")


def test_serve_on_a_database_without_the_schema_says_to_migrate(in_process):
    with fresh_pg_database() as url:
        done = in_process("serve", "--port", "1", TOKENLOOM_DATABASE_URL=url)
    assert_one_line_error(done, "tokenloom db upgrade")


def test_serve_on_a_database_at_an_older_schema_says_to_migrate(in_process):
    from tokenloom.store import migrate

    with fresh_pg_database() as url:
        migrate.upgrade(url, "0009", quiet=True)
        done = in_process("serve", "--port", "1", TOKENLOOM_DATABASE_URL=url)
    assert_one_line_error(done, "revision 0009", migrate.head(), "tokenloom db upgrade")


def test_an_unreachable_database_in_a_real_process(tmp_path):
    url = f"postgresql://postgres:test@127.0.0.1:{closed_port()}/tokenloom"
    assert_one_line_error(tokenloom("keys", "list", cwd=tmp_path, TOKENLOOM_DATABASE_URL=url), "database")


def test_an_unreachable_redis_is_one_line_and_exit_2(tmp_path):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    assert_one_line_error(
        tokenloom("health", "worker", cwd=tmp_path, TOKENLOOM_QUEUE_BROKER_URL=url),
        "Redis",
        "TOKENLOOM_QUEUE_BROKER_URL",
    )


@pytest.mark.parametrize(
    "command, words",
    [
        (("run", "{missing}"), ("input file not found",)),
        (("submit", "{missing}"), ("input file not found",)),
        (("status", "not-a-uuid"), ("not a job or batch id",)),
    ],
    ids=["run", "submit", "status"],
)
def test_bad_input_is_one_line_and_exit_2(command, words, tmp_path, in_process):
    argv = [part.format(missing=tmp_path / "missing.jsonl") for part in command]
    assert_one_line_error(in_process(*argv), *words)


def test_bad_input_in_a_real_process(tmp_path):
    assert_one_line_error(tokenloom("status", "not-a-uuid", cwd=tmp_path), "not a job or batch id")


def test_debug_shows_the_traceback(tmp_path):
    done = tokenloom("--debug", "status", "not-a-uuid", cwd=tmp_path)
    assert done.returncode != 0 and "Traceback (most recent call last)" in done.stderr
    assert "not a job or batch id" in done.stderr


def test_version(tmp_path):
    done = tokenloom("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"tokenloom {package_version()}"
    assert package_version()[0].isdigit()


EVERY_COMMAND = (
    ["run", "x.jsonl"],
    ["serve"],
    ["worker"],
    ["submit", "x.jsonl"],
    ["status", "x"],
    ["cancel", "x"],
    ["db", "upgrade"],
    ["keys", "list"],
    ["keys", "create", "--project", "p"],
    ["keys", "revoke", "x"],
    ["keys", "grant", "x", "--min-priority", "-1"],
    ["sweep", "kv_cache.block_size", "8"],
    ["bench", "quant"],
    ["build-kernels"],
    ["health", "worker"],
)


@pytest.mark.parametrize("command", EVERY_COMMAND, ids=" ".join)
def test_every_command_takes_the_same_logging_options_before_or_after_its_name(command):
    parser = build_parser()
    after = parser.parse_args([*command, "--log-level", "debug", "--log-format", "json", "--debug"])
    before = parser.parse_args(["--log-level", "debug", "--log-format", "json", "--debug", *command])
    for args in (after, before):
        assert (args.log_level, args.log_format, args.debug) == ("debug", "json", True)
    plain = parser.parse_args(command)
    assert (plain.log_level, plain.debug) == (None, False)  # main() resolves None to info (warning: run --quiet)


def test_json_logs_are_one_object_per_line(tmp_path):
    with fresh_pg_database() as url:
        done = tokenloom("db", "upgrade", "--log-format", "json", cwd=tmp_path, TOKENLOOM_DATABASE_URL=url)
        via_env = tokenloom("db", "current", cwd=tmp_path, TOKENLOOM_DATABASE_URL=url, TOKENLOOM_LOG_FORMAT="json")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert any(r["logger"].startswith("alembic") and "upgrade" in r["message"] for r in records), records
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert via_env.returncode == 0 and [json.loads(line) for line in via_env.stderr.splitlines()]
