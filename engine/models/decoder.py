"""One decoder-only transformer that covers every supported family, run over a packed step."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.models.architectures import DecoderShape
from tokenloom.engine.cpu import DecoderStack, build_decoder_stack, decoder_stack_enabled
from tokenloom.engine.models.layers import Attention, DecoderLayer, GatedMLP, RMSNorm


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
                ),
                GatedMLP(shape.hidden_size, shape.intermediate_size, shape.hidden_act, mlp_bias),
                shape.hidden_size,
                shape.rms_norm_eps,
            )
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # RoPE tables for every position, set by the loader: [max_positions, head_dim]
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
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
        ops = backend.layer_ops
        hidden, residual = self.embed_tokens(input_ids), None
        cos = self.rope_cos[positions]
        sin = self.rope_sin[positions]
        stack = self.decoder_stack_for(backend, kv_caches)
        if stack is not None:
            hidden, residual = stack(hidden, cos, sin, metadata)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, metadata, backend, ops)
        # Only sampled positions get the last residual add, the final norm and the LM head (the
        # widest GEMM). Indexing copies, so the fused op may write into both.
        hidden, _ = ops.add_rms_norm(hidden[sample_indices], residual[sample_indices], self.norm.weight, self.norm.eps)
        return self.lm_head(hidden)

    def decoder_stack_for(self, backend, kv_caches) -> DecoderStack | None:
        """The C++ layer loop for these pools, built on first use (None: this model keeps the Python loop)."""
        key = (backend, id(kv_caches), kv_caches[0][0].data_ptr() if kv_caches else 0, decoder_stack_enabled())
        if key != self._stack_key:
            self._stack_key, self._stack = key, build_decoder_stack(self, backend, kv_caches)
        return self._stack
