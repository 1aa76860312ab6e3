"""CUDA graph planning without a GPU: batch-size buckets, which bucket a step takes, when graphs
are off (and why), the one output buffer the graphs share, and the memory they reserve."""

from __future__ import annotations

import pytest
import torch

from tokenloom.engine.runner.cuda_graphs import (
    GRAPH_OVERHEAD_BYTES,
    bucket_for,
    graph_batch_sizes,
    graph_memory_reserve_bytes,
    plan_graphs,
)


def test_buckets_are_1_2_4_then_multiples_of_8_up_to_max_num_seqs():
    assert graph_batch_sizes(256) == (1, 2, 4) + tuple(range(8, 257, 8))
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)  # the largest batch always has a graph
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(1) == (1,)


@pytest.mark.parametrize(("num_seqs", "bucket"), [(1, 1), (3, 4), (5, 8), (8, 8), (9, 16), (250, 256), (256, 256)])
def test_a_decode_step_takes_the_smallest_bucket_that_holds_it(num_seqs, bucket):
    assert bucket_for(num_seqs, graph_batch_sizes(256)) == bucket


def test_more_sequences_than_the_largest_bucket_run_eagerly():
    assert bucket_for(257, graph_batch_sizes(256)) is None


def test_graphs_are_on_for_triton_on_cuda_unless_enforce_eager():
    plan = plan_graphs(torch.device("cuda"), "triton", enforce_eager=False, max_num_seqs=32)
    assert plan.enabled and plan.batch_sizes == (1, 2, 4, 8, 16, 24, 32)
    assert "on for decode steps" in plan.describe() and "1, 2, 4, 8, 16, 24, 32" in plan.describe()
    eager = plan_graphs(torch.device("cuda"), "triton", enforce_eager=True, max_num_seqs=32)
    assert not eager.enabled and "enforce_eager" in eager.describe()


@pytest.mark.parametrize(("device", "backend"), [("cpu", "cpu"), ("cpu", "triton"), ("cuda", "torch")])
def test_graphs_are_off_on_a_cpu_and_for_backends_that_launch_from_host_lists(device, backend):
    plan = plan_graphs(torch.device(device), backend, enforce_eager=False, max_num_seqs=64)
    assert not plan.enabled and plan.batch_sizes == ()
    assert plan.describe().startswith("CUDA graphs: off (")


def test_a_model_that_cannot_be_captured_turns_graphs_off_with_its_reason():
    plan = plan_graphs(
        torch.device("cuda"),
        "triton",
        enforce_eager=False,
        max_num_seqs=32,
        capture_blocker="the routed experts read their row counts on the host",
    )
    assert not plan.enabled
    assert plan.describe() == "CUDA graphs: off (the routed experts read their row counts on the host)"


def test_all_graphs_share_one_hidden_state_buffer_of_the_largest_bucket():
    plan = plan_graphs(torch.device("cuda"), "triton", enforce_eager=False, max_num_seqs=256)
    assert plan.output_buffer_shape(hidden_size=4096) == (256, 4096)


def test_graph_reserve_is_the_largest_decode_one_hidden_buffer_and_each_graphs_overhead():
    plan = plan_graphs(torch.device("cuda"), "triton", enforce_eager=False, max_num_seqs=256)
    assert len(plan.batch_sizes) == 35
    reserve = graph_memory_reserve_bytes(plan, 100 * 2**20, hidden_size=4096, dtype=torch.bfloat16)
    # One [256, 4096] bfloat16 buffer (2 MiB) for all 35 graphs; no [bucket, vocab] logits per graph.
    assert reserve == 100 * 2**20 + 256 * 4096 * 2 + 35 * GRAPH_OVERHEAD_BYTES
    off = plan_graphs(torch.device("cuda"), "triton", enforce_eager=True, max_num_seqs=256)
    assert graph_memory_reserve_bytes(off, 100 * 2**20, hidden_size=4096, dtype=torch.bfloat16) == 0
