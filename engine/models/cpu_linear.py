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
BRGEMM_BLOCK_N = 32  # engine/csrc/brgemm_linear.cpp packs and computes this many output columns per block


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_nbytes = weight.numel() * weight.element_size()
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = choose_kernel(weight)
        if self.kernel == "brgemm":
            self.register_buffer("brgemm_weight", torch.ops.tokenloom_cpu.brgemm_pack_linear_weight(weight))
            self._brgemm_linear = torch.ops.tokenloom_cpu.brgemm_linear.default
        elif self.kernel == "mkl":
            # A plain attribute, not a buffer: MKL's packed data must never move, and module.to()
            # or a state_dict round trip would copy a buffer.
            self.mkl_packed_weight = torch.ops.tokenloom_cpu.mkl_pack_linear_weight(weight)
            self._mkl_linear = torch.ops.tokenloom_cpu.mkl_packed_linear.default
        else:
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "brgemm":
            return self._brgemm_linear(x, self.brgemm_weight, self.in_features, self.bias)
        if self.kernel == "mkl":
            return self._mkl_linear(x, self.mkl_packed_weight, self.in_features, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def choose_kernel(weight: torch.Tensor) -> str:
    if weight.dtype == torch.float32:
        return "mkl" if mkl_packing_available() else "onednn"
    out_features, in_features = weight.shape
    if brgemm_fast() and out_features % BRGEMM_BLOCK_N == 0 and in_features % 2 == 0:
        return "brgemm"
    return "onednn"


@functools.cache
def brgemm_fast() -> bool:
    """Whether bfloat16 layers get tokenloom's brgemm kernel: its C++ kernels build here and the CPU has AMX."""
    from engine.attention.cpu_kernels import CpuKernelsUnavailable, load_cpu_kernels

    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable:
        return False
    return bool(torch.ops.tokenloom_cpu.brgemm_linear_fast())


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


class PackedSwiGLU(nn.Module):
    """A SwiGLU MLP's gate|up projection AND its activation: forward(x) = silu(x @ gate.T) * (x @ up.T).

    The brgemm kernel computes a gate block and the matching up block into float32 tiles and
    writes only the activated product (engine/csrc/brgemm_linear.cpp), rounding where transformers
    rounds; so it is not a linear layer, and GatedMLP calls it in place of gate_up + silu_and_mul.
    """

    fuses_swiglu = True

    def __init__(self, gate_up: PackedLinear):
        super().__init__()
        self.in_features, self.out_features = gate_up.in_features, gate_up.out_features // 2
        self.weight_nbytes, self.kernel = gate_up.weight_nbytes, gate_up.kernel
        blocks = gate_up.brgemm_weight  # [2 * intermediate / BLOCK_N, ...]: gate blocks, then up blocks
        half = blocks.shape[0] // 2
        # Interleave: gate block j, then up block j, so one thread's tiles hold both halves of a column block.
        self.register_buffer("brgemm_weight", torch.stack((blocks[:half], blocks[half:]), dim=1).flatten(0, 1).contiguous())
        self._swiglu = torch.ops.tokenloom_cpu.brgemm_swiglu.default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._swiglu(x, self.brgemm_weight, self.in_features)


PACKED_MODULES = (PackedLinear, PackedSwiGLU)  # what pack_linears leaves in a model


def fuse_swiglu(mlp: nn.Module) -> None:
    """Give a SwiGLU MLP (engine/models/layers.py GatedMLP) the fused gate|up + activation where its layer allows."""
    gate_up = mlp.gate_up_proj
    if (getattr(mlp, "is_swiglu", False) and isinstance(gate_up, PackedLinear) and gate_up.kernel == "brgemm"
            and gate_up.bias is None and (gate_up.out_features // 2) % BRGEMM_BLOCK_N == 0):
        mlp.gate_up_proj = PackedSwiGLU(gate_up)


def pack_linears(module: nn.Module) -> None:
    """Replace every plain nn.Linear below `module` with a PackedLinear, in place.

    Subclasses (bitsandbytes' quantized layers) hold other weight formats and are left alone.
    """
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
    if hasattr(module, "gate_up_proj"):
        fuse_swiglu(module)
