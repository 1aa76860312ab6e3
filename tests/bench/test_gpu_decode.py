"""bench/gpu_decode.py: the bytes a decode step really reads, a checkpoint built whole, rows saved as they come."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from bench.gpu_decode import DecodeReads, decode_reads
from tests.conftest import tiny_llama_checkpoint
from tokenloom.engine.models.loader import load_hf_config, load_model


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


def test_a_checkpoint_build_cut_short_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    """The config is written before the weights: built in place, a build killed in between would
    leave a folder the next run takes for a finished checkpoint. It is built aside and renamed."""
    from bench import gpu_decode

    monkeypatch.setattr(gpu_decode, "default_cache_dir", lambda: tmp_path)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("the section's budget ran out")

    monkeypatch.setattr(gpu_decode, "build_tokenizer", killed)  # after the config and weights are saved
    with pytest.raises(KeyboardInterrupt):
        gpu_decode.checkpoint("tiny", torch.float32, "cpu")
    assert not (tmp_path / "bench-tiny-float32").exists()
    monkeypatch.undo()
    monkeypatch.setattr(gpu_decode, "default_cache_dir", lambda: tmp_path)
    path = gpu_decode.checkpoint("tiny", torch.float32, "cpu")
    assert path == tmp_path / "bench-tiny-float32"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no staging folder left behind


def test_the_decode_rows_are_saved_as_each_system_finishes_a_batch_size(tmp_path, monkeypatch):
    """One engine per system serves every batch size, and the section's record gets the rows so far
    after each measurement: a run cut short keeps them."""
    from bench import gpu_decode
    from bench.gpu_check import RecordedResult

    monkeypatch.setattr(gpu_decode, "default_cache_dir", lambda: tmp_path)
    built = []
    real_engine = gpu_decode.decode_engine
    monkeypatch.setattr(gpu_decode, "decode_engine", lambda *a: built.append(a[2]) or real_engine(*a))
    saves = []

    class Recorded(RecordedResult):
        def save(self):
            saves.append([sorted(k for k in row if k != "batch") for row in self.get("rows", [])])
            super().save()

    progress = Recorded(tmp_path / "decode.json")
    args = gpu_decode.parse(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--backends",
            "torch",
            "--batch-sizes",
            "1",
            "2",
            "--prompt-len",
            "8",
            "--decode-tokens",
            "3",
            "--no-hf",
        ]
    )
    gpu_decode.run(args, progress=progress)
    assert built == ["torch"]  # one engine for both batch sizes
    assert saves[0] == [["torch"], []] and saves[1] == [["torch"], ["torch"]]
    saved = json.loads((tmp_path / "decode.json").read_text())
    assert [row["batch"] for row in saved["rows"]] == [1, 2] and all(
        row["torch"]["step_ms"] > 0 for row in saved["rows"]
    )


def test_graph_tokens_are_compared_with_eager_tokens_of_the_same_batch():
    from bench.gpu_decode import token_agreement

    args = type("Args", (), {"decode_tokens": 4})()
    tokens = {("triton", 2): [[1, 2, 3, 4], [5, 6, 7, 8]], ("triton-eager", 2): [[1, 2, 3, 4], [5, 6, 0, 0]]}
    assert token_agreement(tokens, 2, args) == {"graph_tokens_equal_eager": 6 / 8}
