"""Which attention backend an engine runs: `[model] attention_backend` against the hardware.

- "torch": the reference backend, on any device and dtype.
- "triton": the Triton kernels. They compile for CUDA; on a CPU they run only in triton's
  interpreter (TRITON_INTERPRET=1 set before triton is imported), which exists for tests.
- "cpu": tokenloom's C++ CPU kernels (engine/cpu/csrc, built on first use with the machine's compiler)
  for decodes, torch's SDPA for prefill chunks; CPU only.
- "auto": Triton on CUDA when triton imports and the dtype is one its kernels take; on a CPU the
  C++ kernels when they build here (a warning says why not, then torch); else torch.

The triton modules are imported only here and only when needed, so a CPU install without triton
never touches it. float64 is left to torch: Triton's tl.dot has no float64 path on most GPUs.
"""

from __future__ import annotations

import logging

import torch

from tokenloom.engine.attention.backend import AttentionBackend
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.config import ModelConfig
from tokenloom.engine.cpu import CpuKernelsUnavailable
from tokenloom.engine.models.loader import ModelLoadError

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float64 stays on the exact reference

log = logging.getLogger("tokenloom.engine")


class AttentionBackendError(ModelLoadError):
    """The configured backend cannot run here; a start-up error like a model that fails to load."""


def select_backend(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    choice = config.attention_backend
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "cpu":
        return _explicit_cpu(device, dtype)
    if choice == "auto":
        if device.type == "cpu" and dtype in CPU_KERNEL_DTYPES:
            return _cpu_or_torch()
        if device.type != "cuda" or dtype not in TRITON_DTYPES:
            return TorchAttentionBackend()
        try:
            from tokenloom.engine.attention.triton_backend import RUNS_IN_INTERPRETER, TritonAttentionBackend
        except ImportError:
            return TorchAttentionBackend()
        # TRITON_INTERPRET=1 on a CUDA machine means someone is testing: numpy kernels would crawl.
        return TorchAttentionBackend() if RUNS_IN_INTERPRETER else TritonAttentionBackend()
    return _explicit_triton(device, dtype)


def _explicit_triton(device: torch.device, dtype: torch.dtype):
    if dtype not in TRITON_DTYPES:
        raise AttentionBackendError(
            f'[model] attention_backend = "triton" does not support dtype {str(dtype).removeprefix("torch.")}: '
            'set [model] dtype to bfloat16, float16 or float32, or attention_backend = "torch"'
        )
    try:
        from tokenloom.engine.attention.triton_backend import RUNS_IN_INTERPRETER, TritonAttentionBackend
    except ImportError as err:
        raise AttentionBackendError(
            f'[model] attention_backend = "triton" but triton cannot be imported ({err}): '
            'pip install triton (it ships with CUDA builds of torch), or set attention_backend = "torch"'
        ) from err
    if device.type == "cuda" and RUNS_IN_INTERPRETER:
        raise AttentionBackendError(
            '[model] attention_backend = "triton" on CUDA, but TRITON_INTERPRET=1 makes triton run its '
            "kernels in the CPU interpreter: unset TRITON_INTERPRET"
        )
    if device.type != "cuda" and not RUNS_IN_INTERPRETER:
        raise AttentionBackendError(
            f'[model] attention_backend = "triton" needs a CUDA device, but the model runs on {device.type}: '
            'set attention_backend = "auto" or "torch" (or, for testing only, set TRITON_INTERPRET=1 '
            "in the environment before starting, to run the kernels in triton's slow CPU interpreter)"
        )
    return TritonAttentionBackend()


def _cpu_or_torch():
    from tokenloom.engine.cpu import CpuAttentionBackend

    try:
        return CpuAttentionBackend()
    except CpuKernelsUnavailable as err:
        log.warning(
            '%s; using the slower torch attention backend (set [model] attention_backend = "torch" to silence this)',
            err,
        )
        return TorchAttentionBackend()


def _explicit_cpu(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu":
        raise AttentionBackendError(
            f'[model] attention_backend = "cpu" runs on a CPU, but the model runs on {device.type}: '
            'set attention_backend = "auto"'
        )
    if dtype not in CPU_KERNEL_DTYPES:
        raise AttentionBackendError(
            f'[model] attention_backend = "cpu" does not support dtype {str(dtype).removeprefix("torch.")}: '
            'set [model] dtype to bfloat16, float16 or float32, or attention_backend = "torch"'
        )
    from tokenloom.engine.cpu import CpuAttentionBackend

    try:
        return CpuAttentionBackend()
    except CpuKernelsUnavailable as err:
        raise AttentionBackendError(
            f'[model] attention_backend = "cpu": {err}, or set attention_backend = "torch"'
        ) from err
