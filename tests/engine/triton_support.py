"""What the Triton test files share: where kernels run, and a clear skip when they cannot.

tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before anything imports
triton, so the kernels run in triton's CPU interpreter there.
"""

from __future__ import annotations

import os

import pytest
import torch

from tokenloom.engine.attention.triton_backend import RUNS_IN_INTERPRETER

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def require_kernel_runtime() -> None:
    """Module-level skip (with the reason printed) when neither CUDA nor the interpreter is on."""
    if DEVICE.type == "cpu" and not RUNS_IN_INTERPRETER:
        pytest.skip(
            "no CUDA device and triton was imported before TRITON_INTERPRET=1 could be set "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}): run this file on its own",
            allow_module_level=True,
        )
