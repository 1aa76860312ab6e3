"""The start-up memory profile's step: the largest one the scheduler can plan, laid out as real sequences."""

from __future__ import annotations

import pytest
import torch

from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.engine.models.loader import load_hf_config, load_model
from tokenloom.engine.runner.memory_profile import (
    ProfiledSpan,
    ProfileStep,
    largest_decode_step,
    largest_step,
    profile_inputs,
    profile_num_blocks,
    run_profile_step,
)
from tokenloom.engine.runner.model_runner import ModelRunner


def test_largest_step_packs_the_token_budget_into_full_length_sequences():
    step = largest_step(max_num_batched_tokens=8192, max_model_len=2048, max_num_seqs=16)
    assert step.seq_lens == (2048, 2048, 2048, 2048)
    assert step.num_sampled == 16


def test_largest_step_puts_the_remainder_in_one_shorter_sequence():
    assert largest_step(max_num_batched_tokens=5000, max_model_len=2048, max_num_seqs=16).seq_lens == (2048, 2048, 904)


def test_largest_step_below_max_model_len_is_one_sequence():
    step = largest_step(max_num_batched_tokens=100, max_model_len=4096, max_num_seqs=256)
    assert step.seq_lens == (100,)
    assert step.num_sampled == 100  # no more rows than tokens


def test_largest_step_is_capped_by_max_num_seqs_full_length_sequences():
    step = largest_step(max_num_batched_tokens=8192, max_model_len=2048, max_num_seqs=2)
    assert step.seq_lens == (2048, 2048)
    assert step.num_sampled == 2


def test_profile_inputs_give_each_sequence_its_own_positions_blocks_and_slots():
    step = ProfileStep((5, 3), num_sampled=2)
    ids, positions, sample_indices, metadata = profile_inputs(step, block_size=4, device=torch.device("cpu"))
    assert ids.tolist() == [0] * 8
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert sample_indices.tolist() == [6, 7]
    assert metadata.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]  # the second sequence starts on block 2
    assert [(c.query_start, c.num_query_tokens, c.context_len, c.block_ids) for c in metadata.chunks] == [
        (0, 5, 5, [0, 1]),
        (5, 3, 3, [2]),
    ]
    assert profile_num_blocks(step, block_size=4) == 3


def test_profile_step_runs_through_the_model_each_sequence_attending_only_to_itself(llama_checkpoint):
    model, _ = load_model(llama_checkpoint, load_hf_config(llama_checkpoint), torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend()
    step = ProfileStep((3, 5), num_sampled=8)
    runner = ModelRunner(model, profile_num_blocks(step, 4), 4, backend, torch.device("cpu"), torch.float32)
    ids, positions, sample_indices, metadata = profile_inputs(step, 4, torch.device("cpu"))
    logits = runner.model(ids, positions, runner.kv_caches, metadata, backend, sample_indices)
    assert logits.shape == (8, model.shape.vocab_size)
    # The same tokens at the same positions: the second sequence's first three rows are the first's.
    torch.testing.assert_close(logits[3:6], logits[0:3])


def test_the_graph_profile_step_is_max_num_seqs_decodes_at_position_zero():
    step = largest_decode_step(max_num_seqs=24)
    assert step.seq_lens == (1,) * 24 and step.num_sampled == 24
    _, positions, _, metadata = profile_inputs(step, block_size=16, device=torch.device("cpu"))
    assert positions.tolist() == [0] * 24
    assert all(c.num_query_tokens == 1 for c in metadata.chunks)  # the decode tile, the one graphs replay


def test_start_up_profiles_never_read_past_the_rope_tables_when_max_num_seqs_exceeds_the_model_length(tmp_path):
    """A model of 8 positions served with max_num_seqs 32: the graph profile (32 decodes) and the
    largest eager step both stay inside the 8-row RoPE tables. One sequence of 32 tokens, the
    layout the graph profile must not take, reads past them."""
    checkpoint = build_random_checkpoint(tmp_path / "short", max_position_embeddings=8)
    model, _ = load_model(checkpoint, load_hf_config(checkpoint), torch.float32, torch.device("cpu"))
    assert model.rope_cos.shape[0] == 8
    backend, cpu = TorchAttentionBackend(), torch.device("cpu")
    run_profile_step(model, backend, largest_decode_step(32), 4, cpu, torch.float32, ProfiledSpan.GRAPH_BODY)
    eager = largest_step(max_num_batched_tokens=64, max_model_len=8, max_num_seqs=32)
    assert max(eager.seq_lens) <= 8
    run_profile_step(model, backend, eager, 4, cpu, torch.float32)
    with pytest.raises(IndexError):
        run_profile_step(model, backend, ProfileStep((32,), 32), 4, cpu, torch.float32, ProfiledSpan.GRAPH_BODY)
