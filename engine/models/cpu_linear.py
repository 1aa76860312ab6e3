"""oneDNN-prepacked linear layers for CPU inference.

`nn.Linear` on CPU re-lays out its weight for the GEMM kernel on every call; packing it once at
load (the same reorder torch.compile's freezing does) makes the step's GEMMs 1.4-3x faster on
this project's CPUs, most of all the wide LM head. Outputs equal nn.Linear's up to float32
rounding (different blocking), which the greedy oracle tests cover.
"""

from __future__ import annotations

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
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


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
