"""Loading checkpoints: clear refusals for what tokenloom cannot run; tied weights stay one tensor."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import engine_config, tiny_llama_checkpoint
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.architectures import UnsupportedModelError
from tokenloom.engine.models.loader import ModelLoadError, load_hf_config, load_model
from tokenloom.engine.runner.kv_plan import KVCacheTooSmallError


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, llama_checkpoint):
    for file in llama_checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        Engine(engine_config(tmp_path))


def test_missing_checkpoint_directory_says_what_to_set(tmp_path):
    with pytest.raises(ModelLoadError, match=r"\[model\] name"):
        Engine(engine_config(tmp_path / "nowhere"))


def test_max_model_len_beyond_the_model_limit_is_refused(llama_checkpoint):
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        Engine(engine_config(llama_checkpoint, model=dict(max_model_len=100_000)))


def test_kv_pool_that_cannot_hold_one_full_sequence_refuses_to_start(llama_checkpoint):
    config = engine_config(llama_checkpoint, model=dict(max_model_len=256), kv_cache=dict(num_blocks=4))
    with pytest.raises(KVCacheTooSmallError, match="Lower \\[model\\] max_model_len"):
        Engine(config)


def test_startup_report_states_weights_and_kv_sizes(llama_checkpoint):
    engine = Engine(engine_config(llama_checkpoint, model=dict(max_model_len=128)))
    report = engine.startup_report
    assert "weights:" in report and "bytes per token" in report and "blocks of 16 tokens" in report


def test_tied_embedding_table_and_lm_head_load_as_one_tensor(tmp_path):
    checkpoint = tiny_llama_checkpoint(tmp_path, tie_word_embeddings=True)
    # float16 from a float32 checkpoint: every tensor is converted (as moving to a GPU copies it),
    # and the CPU keeps float16 linears unpacked, so the LM head still holds the weight it loaded.
    model, _ = load_model(checkpoint, load_hf_config(checkpoint), torch.float16, torch.device("cpu"))
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight is model.embed_tokens.weight  # one Parameter: counted once in the weight bytes
