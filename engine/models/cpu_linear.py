"""Prepacked linear layers for CPU inference.

`nn.Linear` on CPU re-lays out its weight for the GEMM kernel on every call; packing it once at
load makes the step's GEMMs 1.4-3x faster on this project's CPUs, most of all the wide LM head.
float32 layers are packed for MKL's packed GEMM (engine/csrc/mkl_packed_linear.cpp: 1.1-1.5x
oneDNN's at decode row counts with the weights streamed from memory, at par on full prefill
steps); bfloat16 layers, and float32 ones where torch has no MKL or the C++ kernels cannot be
built, get oneDNN's prepacked linear (the reorder torch.compile's freezing does). Outputs equal
nn.Linear's up to float32 rounding (different blocking), which the greedy oracle tests cover.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_SIZE_HINT = 64  # the kernel is chosen for this many rows but serves any number


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_nbytes = weight.numel() * weight.element_size()
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = "mkl" if weight.dtype == torch.float32 and mkl_packing_available() else "onednn"
        if self.kernel == "mkl":
            # A plain attribute, not a buffer: MKL's packed data must never move, and module.to()
            # or a state_dict round trip would copy a buffer.
            self.mkl_packed_weight = torch.ops.tokenloom_cpu.mkl_pack_linear_weight(weight)
            self._mkl_linear = torch.ops.tokenloom_cpu.mkl_packed_linear.default
        else:
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "mkl":
            return self._mkl_linear(x, self.mkl_packed_weight, self.in_features, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


@functools.cache
def mkl_packing_available() -> bool:
    """Whether float32 layers can use MKL's packed GEMM: tokenloom's C++ kernels build here and torch has MKL."""
    from engine.attention.cpu_kernels import CpuKernelsUnavailable, load_cpu_kernels

    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable:
        return False
    return bool(torch.ops.tokenloom_cpu.mkl_packed_linear_supported())


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()


def pack_linears(module: nn.Module) -> None:
    """Replace every plain nn.Linear below `module` with a PackedLinear, in place.

    Subclasses (bitsandbytes' quantized layers) hold other weight formats and are left alone.
    """
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
