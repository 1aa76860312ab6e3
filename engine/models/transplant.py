"""Build tokenloom's decoder around the projection modules of a transformers model.

For checkpoints quantized ahead of time (AWQ, GPTQ): transformers' quantizer integrations know how
to load their packed weights into the method's own linear modules (from autoawq / gptqmodel).
tokenloom takes those modules as they are and puts them in its own decoder (paged KV, packed
steps); only the layout differs: where tokenloom fuses q|k|v and gate|up into one GEMM, the
separate quantized modules are called one after the other and their outputs concatenated.
Embeddings, norms and the LM head are ordinary tensors and are copied.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from tokenloom.engine.models.architectures import UnsupportedModelError, decoder_shape
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.models.layers import DecoderLayer, GatedMLP


class ConcatProjection(nn.Module):
    """Several projections of the same input, concatenated: stands in for a fused linear."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(hidden) for part in self.parts], dim=-1)


def load_through_transformers(path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    """The checkpoint as transformers loads it (quantizer included), wired into a DecoderModel."""
    shape = decoder_shape(config)
    features = shape.features
    if (
        features.fused_checkpoint_projections
        or features.output_norms
        or features.norm_weight_offset
        or shape.moe is not None
    ):
        # Their modules are laid out differently (Phi-3's fused projections, Gemma's four norms
        # and (1 + weight), routed experts); only the full-precision loader maps those.
        raise UnsupportedModelError(
            f"AWQ/GPTQ checkpoints of {shape.architecture} are not supported: use its full-precision "
            'checkpoint with [quantization] method = "int8" or "int4"'
        )
    # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to), which mypy reads as unbound
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    inner = hf.model
    first = inner.layers[0]
    with torch.device("meta"):
        model = DecoderModel(
            shape,
            qkv_bias=first.self_attn.q_proj.bias is not None,
            o_bias=first.self_attn.o_proj.bias is not None,
            mlp_bias=getattr(first.mlp.gate_proj, "bias", None) is not None,
            qk_norm=getattr(first.self_attn, "q_norm", None) is not None,
        )
    model.embed_tokens = inner.embed_tokens
    model.norm.weight = nn.Parameter(inner.norm.weight.detach(), requires_grad=False)
    model.lm_head = hf.lm_head
    for module, theirs in zip(model.layers, inner.layers, strict=True):  # both built from one config
        ours = cast(DecoderLayer, module)  # DecoderModel.layers holds DecoderLayers only
        our_mlp = ours.mlp
        assert isinstance(our_mlp, GatedMLP)  # MoE checkpoints were refused above: every MLP is dense
        attn, mlp = theirs.self_attn, theirs.mlp
        ours.self_attn.qkv_proj = ConcatProjection([attn.q_proj, attn.k_proj, attn.v_proj])
        ours.self_attn.o_proj = attn.o_proj
        our_mlp.gate_up_proj = ConcatProjection([mlp.gate_proj, mlp.up_proj])
        our_mlp.down_proj = mlp.down_proj
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(ours, norm).weight = nn.Parameter(getattr(theirs, norm).weight.detach(), requires_grad=False)
        q_norm, k_norm = ours.self_attn.q_norm, ours.self_attn.k_norm
        if q_norm is not None and k_norm is not None:  # Attention builds both or neither (qk_norm_eps)
            q_norm.weight = nn.Parameter(attn.q_norm.weight.detach(), requires_grad=False)
            k_norm.weight = nn.Parameter(attn.k_norm.weight.detach(), requires_grad=False)
    return model
