"""What a decoder family does beyond the Llama block, read once from its config as data.

Every field's default is Llama's behaviour, so Llama, Mistral, Qwen2 and Qwen3 keep
`FamilyFeatures()` and a family states only where it differs. The decoder, the loader, the CPU
decoder stack and the start-up report read these fields; none of them tests an architecture name.

- Gemma 3 (text, `Gemma3ForCausalLM`): RMSNorm scales by (1 + weight); the attention and MLP
  outputs are normalised again before their residual add ("sandwich" norms); embeddings are scaled
  by sqrt(hidden_size); logits scale by query_pre_attn_scalar ** -0.5; sliding layers take RoPE of
  their own base (rope_local_base_freq); the final logits may be soft-capped; GELU-tanh MLP and
  per-head q/k norms come from the config's activation and the checkpoint's tensors.
- Phi-3 / Phi-4 (`Phi3ForCausalLM`): q|k|v and gate|up stored fused in the checkpoint; RoPE may
  turn only part of each head (partial_rotary_factor); longrope is served where it is static.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

# RoPE types whose tables depend only on the position (precomputable once at load). longrope
# switches to its long factors once a sequence outgrows original_max_position_embeddings, so it
# is static below that length, and tokenloom's positions stop there (`rope_position_limit`).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class UnsupportedFamilyConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class FamilyFeatures:
    # RMSNorm multiplies by (offset + weight): Gemma's (1 + weight). The loader folds the offset
    # into the stored weights, so the norm kernels stay the shared ones.
    norm_weight_offset: float = 0.0
    # The attention and MLP outputs are normalised before their residual add (Gemma's extra norms).
    output_norms: bool = False
    # Embeddings are multiplied by this, rounded to the model dtype first as transformers does.
    embedding_multiplier: float | None = None
    # The attention logits' scale; None means head_dim ** -0.5.
    attention_scale: float | None = None
    # logits = cap * tanh(logits / cap) after the LM head (Gemma's final_logit_softcapping).
    final_logit_softcap: float | None = None
    # RoPE turns the first rotary_dim dims of each head and passes the rest; None means all of them.
    rotary_dim: int | None = None
    # Sliding-window layers take RoPE tables of their own base (Gemma 3's rope_local_base_freq).
    local_rope: bool = False
    # The checkpoint stores qkv_proj and gate_up_proj already fused (Phi-3).
    fused_checkpoint_projections: bool = False
    # Positions RoPE is static for (longrope: original_max_position_embeddings); None means no limit
    # below max_position_embeddings.
    rope_position_limit: int | None = None
    # A config value the family's transformers code stores but does not apply, named in the report.
    ignored_config_note: str | None = None

    def layer_loop_differences(self, hidden_act: str) -> list[str]:
        """What this family's layers do beyond the Llama layer (SwiGLU MLP, full RoPE, one RoPE table,
        pre-norms only): the fused C++ decoder stack implements that layer alone, so a family with any
        of these runs the Python layer loop. Empty for Llama-shaped layers."""
        differences = []
        if hidden_act != "silu":
            differences.append(f"{hidden_act} MLP")
        if self.output_norms:
            differences.append("attention/MLP output norms")
        if self.rotary_dim is not None:
            differences.append("partial RoPE")
        if self.local_rope:
            differences.append("two RoPE tables")
        return differences

    def describe(self, head_dim: int) -> list[str]:
        """The features that distinguish this family, in words, for the start-up report."""
        notes = []
        if self.norm_weight_offset:
            notes.append(f"RMSNorm x ({self.norm_weight_offset:g} + weight)")
        if self.output_norms:
            notes.append("post-attention and post-MLP output norms")
        if self.embedding_multiplier is not None:
            notes.append(f"embeddings x {self.embedding_multiplier:.4g}")
        if self.attention_scale is not None:
            notes.append(f"attention scale {self.attention_scale:.4g} (query_pre_attn_scalar)")
        if self.local_rope:
            notes.append("own RoPE base on sliding layers")
        if self.final_logit_softcap is not None:
            notes.append(f"final logits soft-capped at {self.final_logit_softcap:g}")
        if self.rotary_dim is not None:
            notes.append(f"partial RoPE ({self.rotary_dim} of {head_dim} dims per head)")
        if self.fused_checkpoint_projections:
            notes.append("fused qkv/gate_up in the checkpoint")
        if self.rope_position_limit is not None:
            notes.append(f"longrope, static below original_max_position_embeddings = {self.rope_position_limit}")
        if self.ignored_config_note:
            notes.append(self.ignored_config_note)
        return notes


def family_features(config: PretrainedConfig, architecture: str, head_dim: int) -> FamilyFeatures:
    limit = _longrope_limit(config)
    if architecture == "Gemma3ForCausalLM":
        return _gemma3(config, limit)
    if architecture == "Phi3ForCausalLM":
        rope = getattr(config, "rope_parameters", None) or {}
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        return FamilyFeatures(
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            fused_checkpoint_projections=True,
            rope_position_limit=limit,
        )
    return FamilyFeatures(rope_position_limit=limit)


def rope_types(config: PretrainedConfig) -> dict[str, str]:
    """RoPE type per layer type ("all" when every layer shares one table)."""
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    if all(isinstance(value, dict) for value in rope.values()) and rope:  # Gemma 3: one dict per layer type
        return {kind: params.get("rope_type", "default") for kind, params in rope.items()}
    return {"all": rope.get("rope_type", rope.get("type", "default"))}


def _gemma3(config: PretrainedConfig, limit: int | None) -> FamilyFeatures:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedFamilyConfigError(
            "this Gemma 3 checkpoint sets use_bidirectional_attention (an embedding model); "
            "tokenloom generates text with causal attention only"
        )
    cap = getattr(config, "attn_logit_softcapping", None)
    return FamilyFeatures(
        norm_weight_offset=1.0,
        output_norms=True,
        embedding_multiplier=config.hidden_size**0.5,
        attention_scale=config.query_pre_attn_scalar**-0.5,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        local_rope=True,
        rope_position_limit=limit,
        # transformers' Gemma 3 attention never passes this value on (Gemma 3 replaced Gemma 2's
        # attention soft-capping with q/k norms), so applying it would break greedy equality.
        ignored_config_note=(
            f"attn_logit_softcapping = {cap:g} not applied, as in transformers' Gemma 3" if cap is not None else None
        ),
    )


def _longrope_limit(config: PretrainedConfig) -> int | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if "longrope" not in rope_types(config).values():
        return None
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return min(original, config.max_position_embeddings) if original else None
