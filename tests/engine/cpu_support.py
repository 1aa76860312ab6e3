"""Skips for tests of CPU kernels this machine's CPU cannot run (each prints why)."""

from __future__ import annotations

import pytest

from tokenloom.engine.cpu.linear import onednn_bfloat16_supported


def onednn_bfloat16_or_skip() -> None:
    if not onednn_bfloat16_supported():
        pytest.skip("this CPU has no AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: oneDNN cannot pack bfloat16 "
                    "layers here, so bfloat16 models keep plain nn.Linear (covered by the engine tests)")
