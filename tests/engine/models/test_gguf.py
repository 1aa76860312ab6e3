"""engine/models/gguf_checkpoint.py: a GGUF file loads as a checkpoint, converted once, and runs
token for token like transformers running the same file.

The GGUF file is written here with the gguf package's writer, from a tiny random Llama (the demo
tokenizer, quantized Q8_0/Q4_1 linears, a tied embedding table like SmolLM2's): no download.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import engine_config
from tokenloom.engine import Engine, ModelLoadError, SamplingParams, resolve_checkpoint
from tokenloom.engine.models import gguf_checkpoint
from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

PROMPTS = ["Once upon a time", "The quick brown fox", "Numbers like 0 1 2", "A model predicts"]
NUM_HEADS, NUM_KV_HEADS = 4, 2


def _permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows in interleaved-RoPE order; transformers undoes this on load."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_tensor(writer: GGUFWriter, name: str, tensor: torch.Tensor, qtype: GGMLQuantizationType) -> None:
    data = tensor.float().numpy()
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def write_llama_gguf(path, checkpoint_dir):
    """The checkpoint at `checkpoint_dir` as llama.cpp would write it: llama metadata, a gpt2-style
    BPE tokenizer with its chat template, attention weights Q8_0, MLP weights Q4_1, no output.weight
    (tied embeddings)."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    model_json = json.loads((checkpoint_dir / "tokenizer.json").read_text())["model"]
    state = AutoModelForCausalLM.from_pretrained(checkpoint_dir).state_dict()
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_dimension_count(config["hidden_size"] // NUM_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])  # 3 = control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(tokenizer.chat_template)

    q8, q4, f32 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.F32
    _add_tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"], GGMLQuantizationType.F16)
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        q = _permute_for_llama_cpp(state[hf + "self_attn.q_proj.weight"].numpy(), NUM_HEADS)
        k = _permute_for_llama_cpp(state[hf + "self_attn.k_proj.weight"].numpy(), NUM_KV_HEADS)
        _add_tensor(writer, f"blk.{i}.attn_q.weight", torch.from_numpy(q), q8)
        _add_tensor(writer, f"blk.{i}.attn_k.weight", torch.from_numpy(k), q8)
        _add_tensor(writer, f"blk.{i}.attn_v.weight", state[hf + "self_attn.v_proj.weight"], q8)
        _add_tensor(writer, f"blk.{i}.attn_output.weight", state[hf + "self_attn.o_proj.weight"], q8)
        _add_tensor(writer, f"blk.{i}.ffn_gate.weight", state[hf + "mlp.gate_proj.weight"], q4)
        _add_tensor(writer, f"blk.{i}.ffn_up.weight", state[hf + "mlp.up_proj.weight"], q4)
        _add_tensor(writer, f"blk.{i}.ffn_down.weight", state[hf + "mlp.down_proj.weight"], q4)
        _add_tensor(writer, f"blk.{i}.attn_norm.weight", state[hf + "input_layernorm.weight"], f32)
        _add_tensor(writer, f"blk.{i}.ffn_norm.weight", state[hf + "post_attention_layernorm.weight"], f32)
    _add_tensor(writer, "output_norm.weight", state["model.norm.weight"], f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    # Row lengths must be multiples of the 32-value quantization blocks; norms random so they matter.
    source = build_random_checkpoint(
        root / "source",
        seed=3,
        intermediate_size=128,
        max_position_embeddings=256,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    return write_llama_gguf(root / "tiny-llama.Q8_0.gguf", source)


def test_gguf_greedy_tokens_match_transformers_on_the_same_file(gguf_file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    checkpoint = resolve_checkpoint(str(gguf_file), cache_dir=tmp_path)
    engine = Engine(engine_config(checkpoint))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1] :]
        assert output.outputs[0].token_ids == expected.tolist(), prompt


def test_gguf_converted_checkpoint_keeps_config_tokenizer_and_chat_template(gguf_file, tmp_path):
    checkpoint = resolve_checkpoint(str(gguf_file), cache_dir=tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template is not None


def test_gguf_second_load_reuses_the_conversion(gguf_file, tmp_path, monkeypatch):
    first = resolve_checkpoint(str(gguf_file), cache_dir=tmp_path)
    conversions = []
    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", lambda *args: conversions.append(args))
    # The directory holding the one .gguf names the same file, so the same converted copy.
    assert resolve_checkpoint(str(gguf_file.parent), cache_dir=tmp_path) == first
    assert resolve_checkpoint(str(gguf_file), cache_dir=tmp_path) == first
    assert conversions == []


def test_gguf_file_that_is_not_gguf_fails_with_what_to_do(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*point \\[model\\] name"):
        resolve_checkpoint(str(bad), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_gguf_of_an_unsupported_family_names_the_families_it_can_load(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = GGUFWriter(str(path), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'bert' model; tokenloom loads GGUF files of the llama"):
        resolve_checkpoint(str(path), cache_dir=tmp_path / "cache")


def test_directory_with_two_gguf_files_asks_for_one(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="2 .gguf files.*the one file"):
        resolve_checkpoint(str(tmp_path), cache_dir=tmp_path / "cache")
