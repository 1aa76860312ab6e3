"""Device and dtype choice for `[model] device` / `[model] dtype` = "auto"."""

from __future__ import annotations

import logging
import time

import torch

from tokenloom.engine.cpu import PackedLinear, can_pack, in_passing_thread, onednn_bfloat16_supported

log = logging.getLogger("tokenloom.engine")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


class DeviceUnavailableError(RuntimeError):
    """The configured device is not there (e.g. CUDA without a visible GPU): a setting to change."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            '[model] device = "cuda" but no CUDA device is visible: set device = "cpu" or "auto"'
        )
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype, adjusted to what the device computes fast.

    CUDA never runs float32 by default (it doubles memory and bandwidth). On CPU, half precision is
    only used when a quick GEMM probe shows bfloat16 is faster than float32 (many CPUs without
    AMX or AVX512-BF16 emulate it and run several times slower).
    """
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and not onednn_bfloat16_supported():
            log.warning(
                "[model] dtype = bfloat16 on a CPU without AVX-512 or AVX-NE-CONVERT: torch emulates "
                'bfloat16 GEMMs here, several times slower than float32; use dtype = "auto" '
                "(float32 on this CPU) unless you need bfloat16's roundings"
            )
        if name == "float32" and device.type == "cuda":
            log.warning(
                "[model] dtype = float32 on CUDA doubles weight and KV memory and the bytes every "
                "decode step reads (so roughly halves decode speed) compared with bfloat16/float16; "
                'use dtype = "auto" unless you need float32 for a reason'
            )
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
        # Timed on a passing thread: callers include a process's main thread before it starts an
        # engine thread, where an OpenMP team left behind slows every step (engine/cpu/openmp_threads.py).
        _CPU_BF16_FASTER = in_passing_thread(_time_bfloat16_against_float32)
    return _CPU_BF16_FASTER


def _time_bfloat16_against_float32() -> bool:
    # Interleaved rounds, best of each: a one-shot timing flips with whatever else the CPU runs.
    best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
    gemms = {dtype: _packed_gemm(dtype) for dtype in best}
    for _ in range(5):
        for dtype, gemm in gemms.items():
            best[dtype] = min(best[dtype], _seconds(gemm))
    return best[torch.bfloat16] < best[torch.float32]


def _packed_gemm(dtype: torch.dtype):
    """The GEMM the engine runs on CPU: a oneDNN-prepacked linear (engine/cpu/linear.py)."""
    linear = torch.nn.Linear(512, 1024, bias=False).to(dtype)
    layer = PackedLinear(linear) if can_pack(torch.device("cpu"), dtype) else linear
    x = torch.randn(64, 512, dtype=dtype)
    return lambda: layer(x)


@torch.inference_mode()
def _seconds(gemm) -> float:
    gemm()
    start = time.perf_counter()
    for _ in range(5):
        gemm()
    return time.perf_counter() - start


def kv_cache_dtype(model_dtype: torch.dtype, device: torch.device, backend_name: str) -> torch.dtype:
    """The KV pool's dtype: the model's, except float32 under a half-precision model on a CPU when
    the torch reference backend attends.

    torch's CPU attention is several times slower in bfloat16/float16 than in float32 (even on CPUs
    where bfloat16 GEMMs beat float32 ones), and decode
    attention is a large share of a CPU step. The C++ CPU backend reads a half-precision pool
    directly (accumulating in float32) and converts only prefill chunks for SDPA, so with it the
    pool keeps the model's dtype and holds twice the tokens. A fixed rule, not a timing probe: a
    probe taken while the machine is busy picked the slow path.
    """
    if device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16) and backend_name == "torch":
        return torch.float32
    return model_dtype
