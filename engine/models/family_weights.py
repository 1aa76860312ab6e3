"""How a family's checkpoint tensors map onto the shared decoder's parameters.

The shared decoder names its norms by role: `input_layernorm` before attention,
`post_attention_layernorm` before the MLP and, for families with output norms, `attn_output_norm`
and `mlp_output_norm` on the attention and MLP outputs. Gemma's checkpoints name the same four
`input_layernorm`, `pre_feedforward_layernorm`, `post_attention_layernorm` (on the attention
OUTPUT) and `post_feedforward_layernorm`, so they are renamed here; and Gemma's RMSNorm scales by
(1 + weight), so the 1 is folded into every norm weight, in float32 as transformers adds it.
"""

from __future__ import annotations

import torch

from tokenloom.engine.models.family_features import FamilyFeatures

# Gemma checkpoint norm name -> the shared decoder's (all four renamed at once, so none collide).
OUTPUT_NORM_NAMES = {
    "post_attention_layernorm.weight": "attn_output_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp_output_norm.weight",
}


def family_state_dict(state: dict[str, torch.Tensor], features: FamilyFeatures) -> dict[str, torch.Tensor]:
    """`state` (the decoder's names, checkpoint dtype) with the family's renames and norm offsets applied."""
    if features.output_norms:
        state = {_renamed(name): tensor for name, tensor in state.items()}
    if features.norm_weight_offset:
        # Float32 before any cast to the model dtype: transformers computes (1.0 + weight.float()).
        state = {
            name: features.norm_weight_offset + tensor.float() if name.endswith("norm.weight") else tensor
            for name, tensor in state.items()
        }
    return state


def _renamed(name: str) -> str:
    prefix, _, tail = name.partition(".")  # "layers" | "norm" | "embed_tokens" | "lm_head"
    if prefix != "layers":
        return name
    index, _, rest = tail.partition(".")
    return f"layers.{index}.{OUTPUT_NORM_NAMES.get(rest, rest)}"
