"""`[model] attention_backend` picks the backend: torch, triton, or auto (Triton on CUDA only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton reads it when a kernel module is imported

from tokenloom.engine.attention.selection import AttentionBackendError, select_backend  # noqa: E402
from tokenloom.engine.attention.triton_backend import RUNS_IN_INTERPRETER  # noqa: E402
from tokenloom.engine.config import ModelConfig  # noqa: E402
from tokenloom.engine.models.loader import ModelLoadError  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def test_torch_choice_is_the_reference_on_any_device():
    backend = select_backend(ModelConfig(attention_backend="torch"), DEVICE, torch.float32)
    assert backend.name == "torch" and backend.prefers_contiguous_blocks


@pytest.mark.skipif(DEVICE.type != "cuda", reason="auto picks Triton only on a CUDA device; none here")
def test_auto_picks_triton_on_cuda():
    backend = select_backend(ModelConfig(attention_backend="auto"), DEVICE, torch.bfloat16)
    assert backend.name == "triton" and not backend.prefers_contiguous_blocks


def test_triton_choice_runs_here_on_cuda_or_in_the_interpreter():
    assert DEVICE.type == "cuda" or RUNS_IN_INTERPRETER
    backend = select_backend(ModelConfig(attention_backend="triton"), DEVICE, torch.float32)
    assert backend.name == "triton" and backend.needs_varlen_tables


def test_triton_refuses_float64_naming_the_fix():
    with pytest.raises(AttentionBackendError, match="dtype float64.*bfloat16, float16 or float32"):
        select_backend(ModelConfig(attention_backend="triton"), DEVICE, torch.float64)
    # auto falls back to the reference instead.
    assert select_backend(ModelConfig(attention_backend="auto"), DEVICE, torch.float64).name == "torch"


def test_triton_on_cpu_without_interpreter_is_a_startup_error():
    # A fresh process without TRITON_INTERPRET: triton builds its kernels for CUDA only.
    script = textwrap.dedent(
        """
        import torch
        from tokenloom.engine.attention.selection import select_backend
        from tokenloom.engine.config import ModelConfig
        from tokenloom.engine.models.loader import ModelLoadError
        try:
            select_backend(ModelConfig(attention_backend="triton"), torch.device("cpu"), torch.float32)
        except ModelLoadError as err:
            print(err)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA device" in done.stdout and "TRITON_INTERPRET=1" in done.stdout
    assert issubclass(AttentionBackendError, ModelLoadError)  # so `tokenloom run` prints it as a start-up error
