"""bench/gpu_decode.py's bandwidth limit: the bytes a decode step really reads."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from bench.gpu_decode import DecodeReads, decode_reads
from tokenloom.engine.models.loader import load_hf_config, load_model
from tests.conftest import tiny_llama_checkpoint


def _loaded(checkpoint):
    # float16: the CPU keeps these linears unpacked, so the LM head holds the tensor it loaded, as on a GPU.
    model, _ = load_model(checkpoint, load_hf_config(checkpoint), torch.float16, torch.device("cpu"))
    hf = LlamaForCausalLM.from_pretrained(checkpoint)
    return model, hf.num_parameters(), hf.config.vocab_size * hf.config.hidden_size  # a tied table counted once


def test_a_decode_step_reads_a_tied_embedding_table_once_as_the_lm_head(tmp_path):
    model, num_parameters, _ = _loaded(tiny_llama_checkpoint(tmp_path, tie_word_embeddings=True))
    assert decode_reads(model, kv_bytes_per_token=0).weight_bytes == 2 * num_parameters


def test_a_decode_step_reads_no_untied_embedding_table(tmp_path):
    model, num_parameters, table = _loaded(tiny_llama_checkpoint(tmp_path, tie_word_embeddings=False))
    reads = decode_reads(model, kv_bytes_per_token=0)
    assert reads.weight_bytes == 2 * (num_parameters - table)
    assert reads.embedding_row_bytes == 2 * model.shape.hidden_size


def test_step_bytes_add_one_embedding_row_and_the_context_kv_per_sequence():
    reads = DecodeReads(weight_bytes=1000, embedding_row_bytes=8, kv_bytes_per_token=4)
    assert reads.step_bytes(batch=3, context_len=10) == 1000 + 3 * (8 + 10 * 4)
