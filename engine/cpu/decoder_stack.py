"""The decoder layers in one C++ call (engine/cpu/csrc/decoder_stack.cpp) where a model qualifies.

The C++ op runs the Python layer loop's ops in its order on its tensors, so outputs are
identical; it saves the interpreter and dispatch time between them, a visible share of a small
model's CPU step (bench/README.md has the current figures). It serves the common CPU case: the packed KV
layout, linear layers packed for oneDNN or MKL, SwiGLU MLPs, with or without Qwen3's per-head q/k norms.
Anything else (bitsandbytes layers, AMX brgemm layers, the plain KV layout, the torch or Triton
backends, a family whose layers differ from Llama's: `FamilyFeatures.layer_loop_differences`, e.g.
Gemma 3, or Phi with partial RoPE) keeps the Python loop, which stays the reference. Family
features outside the layers (scaled embeddings, soft-capped logits, a custom attention scale,
folded norm offsets) do not matter to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.cpu.linear import PackedLinear

ENABLED = True  # tests and bench A/B runs switch the C++ path off to compare with the Python loop


def decoder_stack_enabled() -> bool:
    """ENABLED read at call time, so a switch made after import counts."""
    return ENABLED


LINEAR_KINDS = {"onednn": 0, "mkl": 1}  # PackedLinear.kernel -> the op's linear_kind


@dataclass(frozen=True)
class DecoderStack:
    weights: list[torch.Tensor]  # per layer: input norm, post-attention norm, qkv, o, gate_up, down[, q norm, k norm]
    biases: list[torch.Tensor | None]  # per layer: qkv, o, gate_up, down
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    windows: list[int]  # per layer sliding window, 0 = none
    shape: list[int]  # num_heads, num_kv_heads, head_dim, hidden_size, intermediate_size
    linear_kind: int
    scale: float
    eps: float
    qk_norm: bool  # Qwen3: every head's q and k normalised before RoPE

    def __call__(self, hidden, cos, sin, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(output of the last layer, residual stream): what the Python loop hands to the final norm."""
        tables = metadata.tables
        # Only the CPU backend serves a decoder stack, and it sets needs_varlen_tables: the runner built them.
        assert tables is not None, "the decoder stack needs the step's varlen tables"
        return torch.ops.tokenloom_cpu.decoder_stack(
            hidden,
            cos,
            sin,
            self.weights,
            self.biases,
            self.key_caches,
            self.value_caches,
            metadata.slot_mapping,
            tables.query_start,
            tables.block_table,
            tables.context_lens,
            self.windows,
            self.shape,
            self.linear_kind,
            self.scale,
            self.eps,
            self.qk_norm,
        )


def build_decoder_stack(model, backend, kv_caches) -> DecoderStack | None:
    """The C++ stack's arguments for this model, backend and pools; None when any part does not qualify."""
    if not ENABLED or not backend.serves_decoder_stack or not kv_caches:
        return None
    if not hasattr(torch.ops.tokenloom_cpu, "decoder_stack") or not backend.uses_packed_layout(kv_caches[0][0]):
        return None
    if model.shape.features.layer_loop_differences(model.shape.hidden_act):
        return None
    dtype = model.embed_tokens.weight.dtype
    layers = list(model.layers)
    linears = [lin for layer in layers for lin in _linears(layer)]
    kinds = {getattr(lin, "kernel", None) for lin in linears}
    if len(kinds) != 1 or not kinds <= LINEAR_KINDS.keys() or not all(isinstance(lin, PackedLinear) for lin in linears):
        return None
    qk_norm = layers[0].self_attn.q_norm is not None
    if any((layer.self_attn.q_norm is not None) != qk_norm or not layer.mlp.is_swiglu for layer in layers):
        return None
    norms = [n for layer in layers for n in _norms(layer)]
    if len({n.eps for n in norms}) != 1 or len({layer.self_attn.scale for layer in layers}) != 1:
        return None
    if any(k.dtype != dtype or v.dtype != dtype for k, v in kv_caches):
        return None
    (kind,) = kinds
    kind = cast(str, kind)  # kinds <= LINEAR_KINDS.keys() above
    first = layers[0].self_attn
    return DecoderStack(
        weights=[t for layer in layers for t in _layer_weights(layer, kind)],
        biases=[lin.bias for lin in linears],
        key_caches=[k for k, _ in kv_caches],
        value_caches=[v for _, v in kv_caches],
        windows=[layer.self_attn.sliding_window or 0 for layer in layers],
        shape=[
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            model.shape.hidden_size,
            layers[0].mlp.intermediate_size,
        ],
        linear_kind=LINEAR_KINDS[kind],
        scale=first.scale,
        eps=norms[0].eps,
        qk_norm=qk_norm,
    )


def _linears(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _norms(layer) -> list:
    attention = layer.self_attn
    qk = [attention.q_norm, attention.k_norm] if attention.q_norm is not None else []
    return [layer.input_layernorm, layer.post_attention_layernorm, *qk]


def _layer_weights(layer, kind: str) -> list[torch.Tensor]:
    """In the op's order: input norm, post-attention norm, qkv, o, gate_up, down[, q norm, k norm]."""
    packed = [lin.mkl_packed_weight if kind == "mkl" else lin.packed_weight for lin in _linears(layer)]
    norms = [n.weight for n in _norms(layer)]
    return [*norms[:2], *packed, *norms[2:]]
