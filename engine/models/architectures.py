"""The decoder families tokenloom runs, and what distinguishes them.

Llama, Mistral, Qwen2 and Qwen3 share one block (RMSNorm, RoPE, GQA attention, SwiGLU MLP);
they differ in projection biases (read from the checkpoint), Qwen3's per-head q/k RMSNorm
(read from the checkpoint) and which layers use a sliding attention window (read here).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


class UnsupportedModelError(ValueError):
    pass


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# RoPE types whose tables depend only on the position (precomputable once at load).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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



def decoder_shape(config: PretrainedConfig) -> DecoderShape:
    architectures = getattr(config, "architectures", None) or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {architectures or config.model_type!r}: "
            f"tokenloom runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported (it changes with sequence length); "
            f"supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
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
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(config, architecture),
    )


def _sliding_windows(config: PretrainedConfig, architecture: str) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if window is None or not layer_types:
        return (None,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
