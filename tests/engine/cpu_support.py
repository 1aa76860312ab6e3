"""Skips for tests of CPU kernels this machine's CPU cannot run (each prints why).

"This CPU" is the instruction-set level the kernels were built for: the CPU's own, or lower under
TOKENLOOM_CPU_ISA (tests/engine/cpu/test_cpu_isa_levels.py runs these tests at each level).
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.engine.cpu import load_cpu_kernels
from tokenloom.engine.cpu.linear import onednn_bfloat16_supported

NO_PACKED_KV = "this CPU has no AVX-512: the packed KV layout (and the C++ layer loop on it) is not built here"


def onednn_bfloat16_or_skip() -> None:
    if not onednn_bfloat16_supported():
        pytest.skip(
            "this CPU has no AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: oneDNN cannot pack bfloat16 "
            "layers here, so bfloat16 models keep plain nn.Linear (covered by the engine tests)"
        )


def packed_kv_supported() -> bool:
    load_cpu_kernels()
    return bool(torch.ops.tokenloom_cpu.packed_kv_supported())


def packed_kv_or_skip() -> None:
    if not packed_kv_supported():
        pytest.skip(NO_PACKED_KV)
