"""The decoder layer's elementwise steps on tokenloom's fused C++ CPU kernels (the LayerOps set
the CPU attention backend names); the reference set is tokenloom.engine.models.layer_ops."""

from __future__ import annotations

import torch


class CpuLayerOps:
    """One C++ pass per step each (engine/cpu/csrc/fused_layer_ops.cpp); mutates its inputs in place,
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
