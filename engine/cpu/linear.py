"""Prepacked linear layers for CPU inference.

`nn.Linear` on CPU re-lays out its weight for the GEMM kernel on every call; packing it once at
load saves that work on every step, most of all for the wide LM head.
float32 layers on Intel CPUs are packed for MKL's packed GEMM (engine/cpu/csrc/mkl_packed_linear.cpp:
1.1-1.5x oneDNN's at decode row counts with the weights streamed from memory, at par on full
prefill steps); bfloat16 layers, float32 ones on other CPUs (see `float32_uses_mkl`) and where torch
has no MKL or the C++ kernels cannot be built, get oneDNN's prepacked linear (the reorder torch.compile's freezing does), which on a CPU
with AMX is run by oneDNN's brgemm micro-kernel through engine/cpu/csrc/brgemm_linear.cpp instead. Outputs equal
nn.Linear's up to float32 rounding (different blocking), which the greedy oracle tests cover.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tokenloom.engine.cpu.instruction_set import CpuIsa, target_isa

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_SIZE_HINT = 64  # the kernel is chosen for this many rows but serves any number
BRGEMM_BLOCK_N = 32  # engine/cpu/csrc/brgemm_linear.cpp packs and computes this many output columns per block
# Rows up to which the brgemm kernel runs a layer that shares oneDNN's packing (None: every row
# count, the engine's choice; bench/roofline.py sets 0 to time oneDNN's GEMM beside it).
BRGEMM_MAX_ROWS: int | None = None


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_nbytes = weight.numel() * weight.element_size()
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = "mkl" if weight.dtype == torch.float32 and float32_uses_mkl() else "onednn"
        self.brgemm_weight = None  # oneDNN's packing seen as the brgemm kernel's (see _share_with_brgemm)
        if self.kernel == "mkl":
            # A plain attribute, not a buffer: MKL's packed data must never move, and module.to()
            # or a state_dict round trip would copy a buffer.
            self.mkl_packed_weight = torch.ops.tokenloom_cpu.mkl_pack_linear_weight(weight)
            self._mkl_linear = torch.ops.tokenloom_cpu.mkl_packed_linear.default
        else:
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT))
            self._share_with_brgemm(weight)

    def _share_with_brgemm(self, weight: torch.Tensor) -> None:
        """On an AMX CPU, run the brgemm kernel (engine/cpu/csrc/brgemm_linear.cpp) on oneDNN's packed bytes.

        oneDNN's bfloat16 packing for AMX is the brgemm kernel's VNNI block layout byte for byte
        (checked here, layer by layer; where it is not, the layer keeps oneDNN), so no second copy
        of the weights. Why brgemm at every row count: a row's result does not depend on how many
        rows share the call (oneDNN picks other blockings for other row counts), so the GEMMs no
        longer make an output depend on its batch (W4, prefix caching on vs off: 64/64 identical,
        60/64 with oneDNN above 32 rows); it ran 1.2-1.75x oneDNN's linear at 1-32 rows and
        0.7-1.4x at 64-512 on the AMX Xeon of bench/README.md (W1 end to end 1.07x).
        """
        out_features, in_features = weight.shape
        if not (
            weight.dtype == torch.bfloat16
            and brgemm_fast()
            and out_features % BRGEMM_BLOCK_N == 0
            and in_features % 2 == 0
        ):
            return
        packed = self.packed_weight
        try:  # torch's accessors for an opaque oneDNN tensor's bytes (private API: absent means no sharing)
            address, nbytes = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
        except (AttributeError, RuntimeError):
            return
        view = torch.ops.tokenloom_cpu.brgemm_view_onednn_weight(address, nbytes, weight)
        if view.numel():
            # Plain attributes: the view aliases oneDNN's buffer, so it must never be copied or saved.
            self.brgemm_weight, self._brgemm_source = view, packed
            self.kernel = "onednn+brgemm"
            self._brgemm_linear = torch.ops.tokenloom_cpu.brgemm_linear.default
            self._brgemm_swiglu = torch.ops.tokenloom_cpu.brgemm_swiglu.default

    def _brgemm_serves(self, x: torch.Tensor) -> bool:
        # The view is valid only while oneDNN's tensor is the one it was taken from (module.to() replaces buffers).
        return (
            self.brgemm_weight is not None
            and self._brgemm_source is self.packed_weight
            and (BRGEMM_MAX_ROWS is None or x.numel() <= BRGEMM_MAX_ROWS * self.in_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "mkl":
            return self._mkl_linear(x, self.mkl_packed_weight, self.in_features, self.out_features, self.bias)
        if self._brgemm_serves(x):
            return self._brgemm_linear(x, self.brgemm_weight, self.in_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def swiglu(self, x: torch.Tensor, ops) -> torch.Tensor:
        """silu(gate) * up of a SwiGLU MLP's fused gate|up layer (gate rows first): in the brgemm
        kernel's epilogue where it serves (engine/cpu/csrc/brgemm_linear.cpp, transformers' roundings),
        else this layer's GEMM, then ops.silu_and_mul."""
        if self.bias is None and self._brgemm_serves(x) and (self.out_features // 2) % BRGEMM_BLOCK_N == 0:
            return self._brgemm_swiglu(x, self.brgemm_weight, self.in_features)
        return ops.silu_and_mul(self(x))


@functools.cache
def brgemm_fast() -> bool:
    """Whether bfloat16 layers get the brgemm kernel: tokenloom's C++ kernels build here and the CPU has AMX."""
    return _cpu_kernel_says("brgemm_linear_fast")


@functools.cache
def mkl_packing_available() -> bool:
    """Whether float32 layers can use MKL's packed GEMM: tokenloom's C++ kernels build here and torch has MKL."""
    return _cpu_kernel_says("mkl_packed_linear_supported")


# Which GEMM float32 layers get: None for the engine's choice (float32_uses_mkl), or "mkl" /
# "onednn" (tests of one kernel, benchmarks comparing the two).
FLOAT32_GEMM: str | None = None


def float32_uses_mkl() -> bool:
    """Whether float32 layers get MKL's packed GEMM: where it can run, on Intel CPUs only.

    MKL picks its generic code paths on other vendors' CPUs, where its packed GEMM loses to oneDNN's
    prepacked linear at decode-sized row counts; on Intel CPUs it wins there (bench/README.md).
    """
    if FLOAT32_GEMM is not None:
        return FLOAT32_GEMM == "mkl" and mkl_packing_available()
    return mkl_packing_available() and cpu_vendor() == "GenuineIntel"


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), "" where it cannot be read."""
    from tokenloom.engine.cpu.instruction_set import cpuinfo_field

    return cpuinfo_field("vendor_id")


def _cpu_kernel_says(probe: str) -> bool:
    """The answer of one of tokenloom's C++ capability ops; False where the kernels cannot be built."""
    from tokenloom.engine.cpu.kernels import CpuKernelsUnavailable, load_cpu_kernels

    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable:
        return False
    return bool(getattr(torch.ops.tokenloom_cpu, probe)())


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or onednn_bfloat16_supported()


@functools.cache
def onednn_bfloat16_supported() -> bool:
    """Whether oneDNN can pack and run bfloat16 GEMMs on this CPU.

    It needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU (AMD Zen 3, older Intel)
    its weight reorder raises, so bfloat16 layers stay plain nn.Linear there (torch emulates them,
    slowly: `dtype = "auto"` picks float32 on such a CPU).
    """
    if target_isa() < CpuIsa.AVX512:  # capped to AVX2 (instruction_set.py): answer as an AVX2-only CPU would
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def pack_linears(module: nn.Module) -> None:
    """Replace every plain nn.Linear below `module` with a PackedLinear, in place.

    Subclasses (bitsandbytes' quantized layers) hold other weight formats and are left alone.
    """
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears(child)
