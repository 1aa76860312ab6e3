"""Device and dtype choice for `[model] device` / `[model] dtype` = "auto"."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("tokenloom.engine")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("[model] device = \"cuda\" but no CUDA device is visible: set device = \"cpu\" or \"auto\"")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype, adjusted to what the device computes fast.

    CUDA never runs float32 by default (it doubles memory and bandwidth). On CPU, half precision is
    only used when a quick GEMM probe shows bfloat16 is faster than float32 (many CPUs without
    AMX or AVX512-BF16 emulate it and run several times slower).
    """
    if name != "auto":
        if name == "float32" and device.type == "cuda":
            log.warning("[model] dtype = float32 on CUDA doubles weight and KV memory and the bytes every "
                        "decode step reads (so roughly halves decode speed) compared with bfloat16/float16; "
                        "use dtype = \"auto\" unless you need float32 for a reason")
        return DTYPES[name]
    if device.type == "cuda":
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if checkpoint_dtype in (torch.float16, torch.bfloat16) and cpu_bfloat16_is_faster():
        return torch.bfloat16
    return torch.float32


_CPU_BF16_FASTER: bool | None = None


def cpu_bfloat16_is_faster() -> bool:
    global _CPU_BF16_FASTER  # measured once per process; the answer cannot change
    if _CPU_BF16_FASTER is None:
        _CPU_BF16_FASTER = _gemm_seconds(torch.bfloat16) < _gemm_seconds(torch.float32)
    return _CPU_BF16_FASTER


def _gemm_seconds(dtype: torch.dtype) -> float:
    a = torch.randn(128, 512, dtype=dtype)
    b = torch.randn(1024, 512, dtype=dtype)
    torch.nn.functional.linear(a, b)
    start = time.perf_counter()
    for _ in range(5):
        torch.nn.functional.linear(a, b)
    return time.perf_counter() - start
