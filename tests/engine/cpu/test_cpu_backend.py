"""The C++ CPU attention backend: chosen by auto on a CPU, equal to the torch reference on a
mixed step, a half-precision pool under a half-precision model, and a clear fallback/error where
the kernels cannot be built (no compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import engine_config
from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext, VarlenTables
from tokenloom.engine.attention.selection import AttentionBackendError, select_backend
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.config import ModelConfig
from tokenloom.engine.cpu.attention_backend import CpuAttentionBackend
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]
CPU = torch.device("cpu")


def test_auto_picks_the_cpu_kernels_on_a_cpu_for_float_dtypes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert select_backend(ModelConfig(attention_backend="auto"), CPU, dtype).name == "cpu"
    assert select_backend(ModelConfig(attention_backend="auto"), CPU, torch.float64).name == "torch"
    with pytest.raises(AttentionBackendError, match="dtype float64"):
        select_backend(ModelConfig(attention_backend="cpu"), CPU, torch.float64)


def _mixed_step(backend, dtype, pool_dtype):
    """Two decodes (one fragmented), a prompt chunk from position 0 and a chunk over 6 cached tokens."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 6, 2, 16, 4
    key_cache = torch.randn(12, block_size, kv_heads, head_dim).to(pool_dtype)
    value_cache = torch.randn(12, block_size, kv_heads, head_dim).to(pool_dtype)
    num_tokens = 2 + 3 + 4
    q, k, v = (torch.randn(num_tokens, n, head_dim).to(dtype) for n in (heads, kv_heads, kv_heads))
    chunks = [
        ChunkContext(0, 1, 10, [4, 5, 6], 16),
        ChunkContext(1, 1, 7, [9, 2], None),
        ChunkContext(2, 3, 3, [7], 28),
        ChunkContext(5, 4, 10, [0, 1, 3], None),
    ]
    slots = [25, 10, 28, 29, 30, 6, 7, 12, 13]  # each new token's slot through its chunk's block table
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=2,
        chunks=chunks,
        tables=VarlenTables.build(chunks, CPU),
    )
    out = backend.forward(q, k, v, key_cache, value_cache, metadata, head_dim**-0.5, None)
    return out, key_cache


@pytest.mark.parametrize(
    "dtype,pool_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_cpu_backend_equals_the_torch_backend_on_a_mixed_step(dtype, pool_dtype):
    expected, expected_cache = _mixed_step(TorchAttentionBackend(), torch.float32, torch.float32)
    actual, cache = _mixed_step(CpuAttentionBackend(), dtype, pool_dtype)
    assert actual.dtype is dtype and cache.dtype is pool_dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16 inputs and outputs
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(cache.float(), expected_cache, atol=tolerance, rtol=tolerance)


def test_bfloat16_engine_on_the_cpu_backend_keeps_a_bfloat16_pool(llama_checkpoint):
    engine = Engine(engine_config(llama_checkpoint).replace("model", dtype="bfloat16"))
    assert engine.backend.name == "cpu" and engine.runner.kv_caches[0][0].dtype is torch.bfloat16
    assert "attention backend cpu" in engine.startup_report
    out = engine.generate(["a b c", "hello"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_without_a_compiler_auto_falls_back_to_torch_and_explicit_cpu_says_what_to_install(tmp_path):
    """A fresh extensions dir and a compiler that does not exist: nothing cached to load, the build fails."""
    script = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from tokenloom.engine.attention.selection import select_backend
        from tokenloom.engine.config import ModelConfig
        from tokenloom.engine.models.loader import ModelLoadError
        print("auto ->", select_backend(ModelConfig(attention_backend="auto"), torch.device("cpu"), torch.float32).name)
        try:
            select_backend(ModelConfig(attention_backend="cpu"), torch.device("cpu"), torch.float32)
        except ModelLoadError as err:
            print("explicit ->", err)
        """
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "auto -> torch" in done.stdout
    assert "could not be built" in done.stderr and "using the slower torch attention backend" in done.stderr
    assert 'explicit -> [model] attention_backend = "cpu"' in done.stdout and "apt install g++" in done.stdout


def test_build_kernels_command_announces_a_first_build_and_says_what_to_install(tmp_path):
    """A fresh extensions dir: the build is announced before the compiler runs; a missing compiler exits 1."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    done = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "build-kernels"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    announced = done.stderr.index("building tokenloom's C++ CPU kernels for this CPU: one time")
    assert announced < done.stderr.index("error: tokenloom's C++ CPU kernels could not be built")
    assert "apt install g++" in done.stderr


def test_build_kernels_command_builds_or_finds_the_cached_library():
    done = subprocess.run(
        [sys.executable, "-m", "tokenloom.cli", "build-kernels"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    library = done.stderr.strip().splitlines()[-1].split(": ", 1)[1]
    assert library.endswith(".so") and os.path.isfile(library)
