"""Per-position tables the decoder indexes each step: RoPE cos/sin, and the embedding multiplier.

The RoPE tables are computed once at load by the family's own transformers rotary module, so
every RoPE type it supports statically (linear, llama3, yarn, longrope below its switch-over
length) matches transformers bit for bit. Gemma 3 has two sets: its sliding layers turn with their
own base (rope_local_base_freq); those layers read `local_rope_cos`/`local_rope_sin`. A table of a
layer type the model does not have stays None.
"""

from __future__ import annotations

import importlib

import torch
import transformers
from transformers import PretrainedConfig

from tokenloom.engine.models.architectures import DecoderShape


def attach_position_tables(model, config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Set the model's RoPE tables (and local ones, and the embedding multiplier, where its family has them)."""
    shape: DecoderShape = model.shape
    features = shape.features
    if features.local_rope:
        # Only the layer types the model has: transformers builds no table for an absent one (a
        # small Gemma 3 can have sliding layers only), and the decoder never reads one.
        present = set(config.layer_types)
        if "full_attention" in present:
            model.rope_cos, model.rope_sin = rope_tables(config, shape, dtype, device, layer_type="full_attention")
        if "sliding_attention" in present:
            model.local_rope_cos, model.local_rope_sin = rope_tables(
                config, shape, dtype, device, layer_type="sliding_attention"
            )
    else:
        model.rope_cos, model.rope_sin = rope_tables(config, shape, dtype, device)
    if features.embedding_multiplier is not None:
        # float32 first, then the model dtype: transformers' buffer is torch.tensor(scale).to(weight dtype).
        model.embed_multiplier = torch.tensor(features.embedding_multiplier).to(dtype=dtype, device=device)


def rope_tables(
    config: PretrainedConfig,
    shape: DecoderShape,
    dtype: torch.dtype,
    device: torch.device,
    layer_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position below shape.max_position_embeddings: [max_positions, rotary_dim] each."""
    family = shape.architecture.removesuffix("ForCausalLM")
    module = importlib.import_module(getattr(transformers, shape.architecture).__module__)
    rotary = getattr(module, f"{family}RotaryEmbedding")(config)
    positions = torch.arange(shape.max_position_embeddings)[None, :]
    extra = () if layer_type is None else (layer_type,)
    cos, sin = rotary(torch.empty(0, dtype=dtype), positions, *extra)
    return cos[0].to(device), sin[0].to(device)
