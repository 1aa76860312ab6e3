"""The elementwise steps of a decoder layer (RMSNorm with the residual add, RoPE, SwiGLU's
activation), as a swappable set: the torch reference here, tokenloom's fused C++ CPU kernels in
tokenloom.engine.cpu.layer_ops.

The model carries the residual stream explicitly (`add_rms_norm` returns the normalised input of
the next block and the updated residual) so that a fused kernel can do the add and the norm in
one pass. Both sets compute the same values: each rounds where transformers' eager code rounds.
The attention backend names the set its device should use (`backend.layer_ops`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    """The elementwise steps a decoder layer calls; each attention backend names its set."""

    def rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


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


TORCH_LAYER_OPS = TorchLayerOps()
