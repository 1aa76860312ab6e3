"""The elementwise steps of a decoder layer (RMSNorm with the residual add, RoPE, SwiGLU's
activation), as a swappable set: the torch reference, or tokenloom's fused C++ CPU kernels.

The model carries the residual stream explicitly (`add_rms_norm` returns the normalised input of
the next block and the updated residual) so that a fused kernel can do the add and the norm in
one pass. Both sets compute the same values: each rounds where transformers' eager code rounds.
The attention backend names the set its device should use (`backend.layer_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and cast back before the weight, exactly as transformers does.
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class TorchLayerOps:
    """The reference: plain torch ops, any device and dtype."""

    def rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(hidden, weight, eps)

    def add_rms_norm(self, hidden, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + hidden
        return rms_norm_reference(residual, weight, eps), residual

    def rotary(self, query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuLayerOps:
    """One C++ pass per step each (engine/csrc/fused_layer_ops.cpp); mutates its inputs in place,
    which the model only passes when it owns them (fresh outputs of the layer before)."""

    def __init__(self):
        self._ops = torch.ops.tokenloom_cpu

    def rms_norm(self, hidden, weight, eps) -> torch.Tensor:
        out = torch.empty_like(hidden)
        self._ops.rms_norm(out, hidden, weight, eps)
        return out

    def add_rms_norm(self, hidden, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.fused_add_rms_norm(hidden, residual, weight, eps)
        return hidden, residual

    def rotary(self, query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.rotary_embedding(query, key, cos, sin)
        return query, key

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._ops.silu_and_mul(out, gate_up)
        return out


TORCH_LAYER_OPS = TorchLayerOps()
