"""Building blocks of the decoder, numerically matching transformers' implementations.

Projections are fused at load (q|k|v into one matrix, gate|up into one) so a step runs two
GEMMs fewer per layer; they stay `nn.Linear` so weight-only quantization can swap them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from transformers.activations import ACT2FN

from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.models.layer_ops import rms_norm_reference

if TYPE_CHECKING:  # annotations only, so that moe.py stays free to import the building blocks here
    from tokenloom.engine.models.moe import RoutedExperts


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(hidden, self.weight, self.eps)


class _FusesSwiglu(Protocol):
    """A gate|up projection that fuses the SwiGLU activation (engine/cpu/linear.py's PackedLinear)."""

    def swiglu(self, x: torch.Tensor, ops: Any) -> torch.Tensor: ...


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        self.intermediate_size = intermediate_size
        # nn.Linear until quantization, CPU packing or transplant.py swaps in another projection module.
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj: nn.Module = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACT2FN[hidden_act]
        self.is_swiglu = hidden_act == "silu"  # the fused kernel's case; other activations stay in torch

    def forward(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        if self.is_swiglu and hasattr(self.gate_up_proj, "swiglu"):  # a PackedLinear may fuse the activation
            return self.down_proj(cast(_FusesSwiglu, self.gate_up_proj).swiglu(hidden, ops))
        gate_up = self.gate_up_proj(hidden)
        if self.is_swiglu:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        sliding_window: int | None,
        scale: float | None = None,  # None: head_dim ** -0.5 (Gemma 3 sets query_pre_attn_scalar ** -0.5)
        rotary_dim: int | None = None,  # RoPE on the first rotary_dim dims only (Phi's partial RoPE); None: all
        uses_local_rope: bool = False,  # this layer takes the model's local RoPE tables (Gemma 3's sliding layers)
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.rotary_dim = rotary_dim
        self.uses_local_rope = uses_local_rope
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        # nn.Linear until quantization, CPU packing or transplant.py swaps in another projection module.
        self.qkv_proj: nn.Module = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj: nn.Module = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        # Qwen3 normalises each head's q and k before RoPE.
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        backend,
        ops,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # built together from qk_norm_eps
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is None:
            q, k = ops.rotary(q, k, cos, sin)
        else:  # cos/sin: [num_tokens, rotary_dim]; the remaining dims pass through unturned
            turned_q, turned_k = ops.rotary(q[..., : self.rotary_dim], k[..., : self.rotary_dim], cos, sin)
            q = torch.cat([turned_q, q[..., self.rotary_dim :]], dim=-1)
            k = torch.cat([turned_k, k[..., self.rotary_dim :]], dim=-1)
        out = backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale, self.sliding_window
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        attention: Attention,
        mlp: GatedMLP | RoutedExperts,
        hidden_size: int,
        eps: float,
        output_norms: bool = False,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)  # the MLP's input norm
        self.mlp = mlp
        # Gemma normalises the attention and MLP outputs before each residual add (its checkpoint's
        # post_attention_layernorm and post_feedforward_layernorm; the loader renames them).
        self.attn_output_norm = RMSNorm(hidden_size, eps) if output_norms else None
        self.mlp_output_norm = RMSNorm(hidden_size, eps) if output_norms else None

    def forward(self, hidden, residual, cos, sin, kv_cache, metadata, backend, ops):
        """hidden: the previous layer's output (the embeddings at layer 0, where residual is None);
        residual: the running sum of the stream. Returns this layer's (output, residual)."""
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            hidden, residual = ops.add_rms_norm(hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, metadata, backend, ops)
        if self.attn_output_norm is not None:
            hidden = ops.rms_norm(hidden, self.attn_output_norm.weight, self.attn_output_norm.eps)
        norm = self.post_attention_layernorm
        hidden, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.mlp(hidden, ops)
        if self.mlp_output_norm is not None:  # the next layer's add_rms_norm adds it to the stream
            hidden = ops.rms_norm(hidden, self.mlp_output_norm.weight, self.mlp_output_norm.eps)
        return hidden, residual
