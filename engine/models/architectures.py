"""The decoder families tokenloom runs, and what distinguishes them.

Llama, Mistral, Qwen2 and Qwen3 share one block (RMSNorm, RoPE, GQA attention, SwiGLU MLP);
they differ in projection biases (read from the checkpoint), Qwen3's per-head q/k RMSNorm
(read from the checkpoint) and which layers use a sliding attention window (read here).
Gemma 3 and Phi-3/Phi-4 share that block too; what they do differently is data, a
`FamilyFeatures` read from the config (engine/models/family_features.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from tokenloom.engine.models.family_features import (
    STATIC_ROPE_TYPES,
    FamilyFeatures,
    UnsupportedFamilyConfigError,
    family_features,
    rope_types,
)
from tokenloom.engine.models.moe import MoeShape, moe_shape


class UnsupportedModelError(ValueError):
    pass


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


@dataclass(frozen=True, slots=True)
class DecoderShape:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    moe: MoeShape | None = None  # routed-experts MLP (Qwen3-MoE, Mixtral); None = dense MLP in every layer
    features: FamilyFeatures = FamilyFeatures()  # what the family does beyond the Llama block


def decoder_shape(config: PretrainedConfig) -> DecoderShape:
    architectures = getattr(config, "architectures", None) or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {architectures or config.model_type!r}: "
            f"tokenloom runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for rope_type in rope_types(config).values():
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not supported (it changes with sequence length); "
                f"supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        features = family_features(config, architecture, head_dim)
    except UnsupportedFamilyConfigError as err:
        raise UnsupportedModelError(str(err)) from err
    return DecoderShape(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        hidden_act=getattr(config, "hidden_act", None) or config.hidden_activation,  # Gemma: hidden_activation
        # RoPE tables end where they stop being static (longrope), and max_model_len with them.
        max_position_embeddings=features.rope_position_limit or config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(config, architecture),
        moe=moe_shape(config, architecture),
        features=features,
    )


def _sliding_windows(config: PretrainedConfig, architecture: str) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if architecture in (
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Phi3ForCausalLM",
    ):  # one window, all layers
        return (window,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if window is None or not layer_types:
        return (None,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
