"""The decoder's forward in two parts (engine/models/decoder.py): the final hidden states, which a
CUDA graph captures, then the LM head, which runs after the replay. The two together must be the
full forward bit for bit, so a graph step's logits are the eager step's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ORACLE_CONFIG, engine_config
from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

# Gemma 3 for the final-logit softcap, which belongs to the LM head's part.
GEMMA3 = dict(
    architecture="Gemma3ForCausalLM",
    num_hidden_layers=2,
    head_dim=16,
    sliding_window=16,
    query_pre_attn_scalar=24,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention"],
)


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("gemma3"), seed=3, **ORACLE_CONFIG, **GEMMA3)


def _prefill_args(engine: Engine, num_tokens: int, sampled: list[int]):
    """One prefill of `num_tokens` seeded random tokens into a fresh pool's first blocks."""
    runner = engine.runner
    blocks = list(range(-(-num_tokens // runner.block_size)))
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        num_decodes=0,
        chunks=[ChunkContext(0, num_tokens, num_tokens, blocks, 0)],
    )
    ids = torch.randint(3, engine.loaded.shape.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    return ids, torch.arange(num_tokens), runner.kv_caches, metadata, runner.backend, torch.tensor(sampled)


@pytest.mark.parametrize(("family", "backend"), [("llama", "cpu"), ("llama", "torch"), ("gemma3", "torch")])
def test_hidden_states_then_lm_head_equal_the_full_forward(family, backend, llama_checkpoint, gemma3_checkpoint):
    checkpoint = llama_checkpoint if family == "llama" else gemma3_checkpoint
    engine = Engine(engine_config(checkpoint, model=dict(attention_backend=backend, max_model_len=128)))
    model = engine.runner.model
    args = _prefill_args(engine, 21, sampled=[4, 13, 20])
    full = model(*args)  # [3, vocab]
    hidden = model.hidden_states(*args)  # the pass above wrote the same KV slots with the same values
    assert hidden.shape == (3, engine.loaded.shape.hidden_size)
    split = model.compute_logits(hidden)
    assert split.shape == full.shape and torch.equal(split, full)
    if family == "gemma3":  # the softcap is the LM head's part's to apply
        assert model.shape.features.final_logit_softcap == 30.0
