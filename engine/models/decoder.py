"""One decoder-only transformer that covers every supported family, run over a packed step."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.cpu import DecoderStack, build_decoder_stack, decoder_stack_enabled
from tokenloom.engine.models.architectures import DecoderShape
from tokenloom.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm
from tokenloom.engine.models.moe import RoutedExperts


def _table_rows(
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows `positions` of a (cos, sin) RoPE table pair; None when the pair is not set."""
    if cos is None:
        return None
    if sin is None:  # position_tables.py sets both tables of a pair together
        raise RuntimeError("a RoPE cos table is set without its sin table")
    return cos[positions], sin[positions]


class DecoderModel(nn.Module):
    def __init__(
        self,
        shape: DecoderShape,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
        qk_norm: bool,
    ):
        super().__init__()
        self.shape = shape
        features = shape.features
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                Attention(
                    shape.hidden_size,
                    shape.num_heads,
                    shape.num_kv_heads,
                    shape.head_dim,
                    qkv_bias=qkv_bias,
                    o_bias=o_bias,
                    qk_norm_eps=shape.rms_norm_eps if qk_norm else None,
                    sliding_window=shape.sliding_windows[i],
                    scale=features.attention_scale,
                    rotary_dim=features.rotary_dim,
                    uses_local_rope=features.local_rope and shape.sliding_windows[i] is not None,
                ),
                RoutedExperts(shape.hidden_size, shape.moe, shape.hidden_act)
                if shape.moe and shape.moe.sparse_layers[i]
                else GatedMLP(shape.hidden_size, shape.intermediate_size, shape.hidden_act, mlp_bias),
                shape.hidden_size,
                shape.rms_norm_eps,
                output_norms=features.output_norms,
            )
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # RoPE tables for every position, set by the loader: [max_positions, rotary_dim]
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        # Tables of the layers with `uses_local_rope` (Gemma 3's sliding layers); None elsewhere.
        self.local_rope_cos: torch.Tensor | None = None
        self.local_rope_sin: torch.Tensor | None = None
        # A 0-d tensor in the model dtype the embeddings are multiplied by (Gemma), set by the loader.
        self.embed_multiplier: torch.Tensor | None = None
        # The C++ layer loop for the (backend, pools) it was built for; see decoder_stack_for.
        self._stack_key: tuple | None = None
        self._stack: DecoderStack | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key pool, value pool)
        metadata: AttentionMetadata,
        backend,
        sample_indices: torch.Tensor,  # [num_sampled] rows of the batch whose logits are needed
    ) -> torch.Tensor:  # [num_sampled, vocab_size]
        return self.compute_logits(
            self.hidden_states(input_ids, positions, kv_caches, metadata, backend, sample_indices)
        )

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        backend,
        sample_indices: torch.Tensor,  # [num_sampled]
    ) -> torch.Tensor:  # [num_sampled, hidden_size], after the final norm
        """The forward up to the LM head: what a CUDA graph captures (engine/runner/cuda_graphs.py),
        so that no graph holds a [batch, vocab] output of its own."""
        ops = backend.layer_ops
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_multiplier is not None:
            hidden = hidden * self.embed_multiplier
        # A table is None where no layer uses it (Gemma 3 with sliding layers only).
        cos, sin = _table_rows(self.rope_cos, self.rope_sin, positions) or (None, None)
        stack = self.decoder_stack_for(backend, kv_caches)
        if stack is not None:
            hidden, residual = stack(hidden, cos, sin, metadata)
        else:
            local = _table_rows(self.local_rope_cos, self.local_rope_sin, positions)
            for module, kv_cache in zip(self.layers, kv_caches):
                layer = cast(DecoderLayer, module)  # self.layers holds DecoderLayers only
                layer_cos: torch.Tensor | None
                layer_sin: torch.Tensor | None
                if layer.self_attn.uses_local_rope:
                    if local is None:  # position_tables.py sets them whenever a layer uses them
                        raise RuntimeError("a layer uses local RoPE, but the local RoPE tables are not set")
                    layer_cos, layer_sin = local
                else:
                    layer_cos, layer_sin = cos, sin
                hidden, residual = layer(hidden, residual, layer_cos, layer_sin, kv_cache, metadata, backend, ops)
        if residual is None:  # only a model without layers; every layer returns its residual
            raise RuntimeError("the model has no decoder layers")
        # Only sampled positions get the last residual add, the final norm and the LM head (the
        # widest GEMM). Indexing copies, so the fused op may write into both.
        hidden, _ = ops.add_rms_norm(hidden[sample_indices], residual[sample_indices], self.norm.weight, self.norm.eps)
        return hidden

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor
    ) -> torch.Tensor:  # [num_sampled, hidden_size] -> [num_sampled, vocab]
        logits = self.lm_head(hidden)
        cap = self.shape.features.final_logit_softcap
        if cap is not None:  # transformers' order of ops, so the rounding matches
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decoder_stack_for(self, backend, kv_caches) -> DecoderStack | None:
        """The C++ layer loop for these pools, built on first use (None: this model keeps the Python loop)."""
        key = (backend, id(kv_caches), kv_caches[0][0].data_ptr() if kv_caches else 0, decoder_stack_enabled())
        if key != self._stack_key:
            # The C++ stack has no routed-experts MLP: MoE models keep the Python loop.
            self._stack_key, self._stack = (
                key,
                None if self.shape.moe else build_decoder_stack(self, backend, kv_caches),
            )
        return self._stack
