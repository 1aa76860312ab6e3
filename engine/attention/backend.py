"""The interface every attention backend implements, with its capabilities as typed attributes.

Generic code (the model runner, the decoder, the engine's start-up report) asks a backend through
this class only: what it can do is declared here, not discovered with getattr/hasattr, and no
generic module imports a particular backend's kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata
from tokenloom.engine.models.layer_ops import LayerOps


class AttentionBackend(ABC):
    name: ClassVar[str]  # what [model] attention_backend calls it
    # Prefill chunks over a cached prefix read the pool as one view when its blocks are contiguous,
    # so the block allocator should hand out runs where it can; the model runner finds each chunk's
    # `contiguous_start_slot` only for these backends (None for the others).
    prefers_contiguous_blocks: ClassVar[bool]
    # The step's flat block table and context lengths are built for the kernels (model_runner).
    needs_varlen_tables: ClassVar[bool] = False
    # Qualifying models may run all decoder layers in one fused call (engine/cpu/decoder_stack.py).
    serves_decoder_stack: ClassVar[bool] = False
    layer_ops: LayerOps  # the norm, RoPE and SwiGLU implementations the decoder uses with this backend

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into the pool, then attend every chunk of the step."""

    def uses_packed_layout(self, key_cache: torch.Tensor) -> bool:
        """Whether this pool is in a kernel-specific packed layout (only the CPU backend has one)."""
        return False

    def describe(self, key_cache: torch.Tensor) -> str:
        """Which kernels serve this pool, for the start-up report; "" when there is nothing to add."""
        return ""
