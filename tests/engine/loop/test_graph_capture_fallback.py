"""A CUDA-graph capture that fails leaves an engine that serves every request eagerly and says why.

Capture runs only on CUDA; here the engine is given the plan a CUDA device with the Triton backend
gets, and the capture raises what CUDA raises for an op that capture rejects.
"""

from __future__ import annotations

import logging

import torch

from tests.conftest import engine_config
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.loop import engine as engine_module
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.runner.cuda_graphs import DecodeGraphs, GraphPlan, graph_batch_sizes
from tokenloom.engine.runner.model_runner import ModelRunner
from tokenloom.engine.sample.sampling_params import SamplingParams

CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"
PROMPTS = [[1, 17, 42, 99, 5], [1, 200, 3], [1, 7] * 9]


def _greedy(engine: Engine) -> list[list[int]]:
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


def test_a_failed_capture_leaves_an_engine_that_serves_eagerly_with_the_reason_in_its_report(
    llama_checkpoint, monkeypatch, caplog
):
    config = engine_config(llama_checkpoint, model=dict(max_model_len=128), scheduler=dict(max_num_seqs=8))
    expected = _greedy(Engine(config))
    attempts = []

    def planned_on_cuda(device, backend_name, enforce_eager, max_num_seqs, capture_blocker=None):
        return GraphPlan(graph_batch_sizes(max_num_seqs))

    def failing_capture(self, model, kv_caches, backend):
        attempts.append(self.batch_sizes)
        raise RuntimeError(CAPTURE_ERROR)

    monkeypatch.setattr(engine_module, "plan_graphs", planned_on_cuda)
    monkeypatch.setattr(DecodeGraphs, "capture", failing_capture)
    with caplog.at_level(logging.WARNING, logger="tokenloom.engine"):
        engine = Engine(config)
    assert attempts == [(1, 2, 4, 8)]  # capture was tried, with the plan a CUDA device gets
    assert engine.runner.graphs is None and not engine.graph_plan.enabled
    reason = f"capture failed with RuntimeError: {CAPTURE_ERROR}; decode steps run eagerly"
    assert f"CUDA graphs: off ({reason})" in engine.startup_report
    assert reason in caplog.text
    assert _greedy(engine) == expected  # every request served, token for token as an engine without graphs


def test_a_runner_without_step_buffers_reports_why_it_cannot_capture():
    """The buffers graphs read their inputs from exist on CUDA only: elsewhere capture fails with
    that reason instead of an error from inside a half-built graph."""

    class _Shape:  # all a runner reads of its model before a forward
        num_layers, num_kv_heads, head_dim = 1, 1, 16

    class _Model:
        shape = _Shape()

    runner = ModelRunner(_Model(), 4, 4, TorchAttentionBackend(), torch.device("cpu"), torch.float32)
    plan = runner.capture_graphs(GraphPlan((1, 2)))
    assert not plan.enabled and runner.graphs is None
    assert "step buffers" in plan.describe() and "decode steps run eagerly" in plan.describe()
