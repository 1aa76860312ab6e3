"""`[metrics] enable_ttft / enable_tpot / enable_throughput` switch recording: a figure switched off
is None (or absent) in every request's metrics, result line and run summary; the rest still come."""

from __future__ import annotations

import json

import pytest

from tests.conftest import engine_config
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.offline.offline_run import run_file

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _metrics(checkpoint, **switches):
    engine = Engine(engine_config(checkpoint, metrics=switches))
    [output] = engine.generate([[1, 5, 9, 13]], PARAMS)
    return engine, output.metrics


def test_everything_is_recorded_by_default(family_checkpoints):
    _, metrics = _metrics(family_checkpoints["llama"])
    assert metrics.ttft_s is not None and metrics.tpot_s is not None and len(metrics.itl_s) == 5


def test_ttft_off(family_checkpoints):
    _, metrics = _metrics(family_checkpoints["llama"], enable_ttft=False)
    assert metrics.ttft_s is None and metrics.tpot_s is not None and metrics.e2e_s is not None


def test_tpot_off_records_no_token_times(family_checkpoints):
    engine, metrics = _metrics(family_checkpoints["llama"], enable_tpot=False)
    assert metrics.tpot_s is None and metrics.itl_s == [] and metrics.ttft_s is not None


@pytest.mark.parametrize("enabled", [True, False])
def test_throughput_switch_in_the_run_summary(family_checkpoints, tmp_path, enabled):
    engine = Engine(
        engine_config(family_checkpoints["llama"], metrics=dict(enable_throughput=enabled, enable_ttft=False))
    )
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}) + "\n")
    summary = run_file(engine, source, output, progress=False)
    assert (summary.output_tok_s is not None) == enabled
    assert ("tok/s" in summary.format()) == enabled
    [line] = output.read_text().splitlines()
    assert json.loads(line)["ttft_s"] is None and json.loads(line)["status"] == "succeeded"
