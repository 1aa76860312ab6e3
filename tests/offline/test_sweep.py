"""`tokenloom sweep` / `tokenloom bench quant`: value parsing, and real runs on a tiny model."""

from __future__ import annotations

import csv

import pytest

from tests.cli.test_cli import cli
from tokenloom.cli.sweep_values import parse_values
from tokenloom.engine.config import ConfigError
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REQUESTS = ["--requests", "4", "--prompt-tokens", "16", "--output-tokens", "8"]


def test_ranges_are_inclusive_and_typed():
    assert parse_values("kv_cache.gpu_memory_utilization", "0.60:0.95:0.05") == [
        0.6,
        0.65,
        0.7,
        0.75,
        0.8,
        0.85,
        0.9,
        0.95,
    ]
    assert parse_values("scheduler.max_num_seqs", "8:64:8") == [8, 16, 24, 32, 40, 48, 56, 64]
    assert parse_values("kv_cache.block_size", "8,16,32") == [8, 16, 32]
    assert parse_values("quantization.method", "none,int8,int4") == ["none", "int8", "int4"]


@pytest.mark.parametrize(
    "key, values, message",
    [
        ("kv_cache.blocksize", "8", "has no key 'blocksize'"),
        ("nosuch.key", "1", "is not SECTION.KEY"),
        ("kv_cache.block_size", "0,16", "out of range"),
        ("kv_cache.gpu_memory_utilization", "0.9:0.6:0.1", "STOP >= START"),
        ("quantization.method", "int3", "one of"),
    ],
)
def test_bad_keys_and_values_are_refused_with_a_reason(key, values, message):
    with pytest.raises(ConfigError, match=message):
        parse_values(key, values)


@pytest.fixture(scope="module")
def model_env(tmp_path_factory):
    checkpoint = build_random_checkpoint(
        tmp_path_factory.mktemp("sweep") / "llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {
        "TOKENLOOM_MODEL_NAME": str(checkpoint),
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": "64",
        "TOKENLOOM_MODEL_DTYPE": "float32",
    }


def test_sweep_writes_csv_and_chart_and_keeps_going_past_a_value_that_cannot_run(model_env, tmp_path):
    # 2 blocks of 16 tokens cannot hold one 64-token sequence: that value fails, the others run.
    done = cli(["sweep", "kv_cache.num_blocks", "2,16,64", *REQUESTS, "-o", "out"], tmp_path, **model_env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "out.csv")))
    assert [r["value"] for r in rows] == ["2", "16", "64"]
    assert "KV cache too small" in rows[0]["error"] and rows[0]["throughput_tok_s"] == ""
    for row in rows[1:]:
        assert row["error"] == "" and float(row["throughput_tok_s"]) > 0 and float(row["peak_memory_gib"]) > 0
    assert int(rows[1]["preemptions"]) >= int(rows[2]["preemptions"])  # a smaller pool preempts more
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")
    assert "best operating point: kv_cache.num_blocks =" in done.stderr


def test_bench_quant_compares_full_precision_int8_and_int4(model_env, tmp_path):
    done = cli(["bench", "quant", *REQUESTS], tmp_path, **model_env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "bench-quant.csv")))
    assert [r["value"] for r in rows] == ["none", "int8", "int4"] and not any(r["error"] for r in rows)
    weights = [float(r["weight_mib"]) for r in rows]
    assert weights[0] > weights[1] > weights[2]  # int8 and int4 shrink the decoder's linears
    assert "| none | 4/4 | 100.0% |" in done.stdout  # full precision agrees with itself
    assert "| int8 |" in done.stdout and "| int4 |" in done.stdout


def test_bad_sweep_value_exits_2_with_the_reason(model_env, tmp_path):
    done = cli(["sweep", "kv_cache.block_size", "0,16"], tmp_path, **model_env)
    assert done.returncode == 2 and "out of range" in done.stderr
