"""How many KV blocks to allocate, and the refusal to start when one full-length sequence won't fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.engine.config import KVCacheConfig
from tokenloom.engine.models.architectures import DecoderShape

GIB = 2**30


class KVCacheTooSmallError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    block_size: int
    num_blocks: int
    bytes_per_token: int  # K and V of every layer for one token
    num_swap_blocks: int = 0  # host blocks for preempted sequences' KV ([kv_cache] swap_space_gb)

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_token_slots * self.bytes_per_token


def kv_bytes_per_token(shape: DecoderShape, dtype: torch.dtype) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def plan_kv_pool(
    config: KVCacheConfig,
    shape: DecoderShape,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_seqs: int,
    activation_bytes: int = 0,
) -> KVPoolPlan:
    """`activation_bytes`: what the largest step needs beyond weights and pool (CUDA; measured by
    engine/runner/memory_profile.py, plus the CUDA graphs' reserve), kept out of the pool's share of
    gpu_memory_utilization."""
    bytes_per_token = kv_bytes_per_token(shape, dtype)
    block_bytes = bytes_per_token * config.block_size
    blocks_per_seq = -(-max_model_len // config.block_size)
    if config.num_blocks:
        num_blocks, budget, source = config.num_blocks, config.num_blocks * block_bytes, "[kv_cache] num_blocks"
    else:
        budget, source = _memory_budget(config, device, activation_bytes)
        # Never allocate more than every admitted sequence could use at full length.
        num_blocks = min(budget // block_bytes, max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq:
        raise KVCacheTooSmallError(
            f"KV cache too small: one max_model_len={max_model_len} sequence needs "
            f"{blocks_per_seq * block_bytes / GIB:.3f} GiB ({blocks_per_seq} blocks of {config.block_size} tokens) "
            f"but {source} allows {budget / GIB:.3f} GiB ({num_blocks} blocks). Lower [model] max_model_len, "
            "raise [kv_cache] gpu_memory_utilization / cpu_kv_space_gb / num_blocks, enable "
            "[quantization] int8 to free weight memory, or use a smaller model."
        )
    # Swap space beyond what every pool block could ever need is never used.
    num_swap_blocks = min(int(config.swap_space_gb * GIB) // block_bytes, int(num_blocks))
    return KVPoolPlan(config.block_size, int(num_blocks), bytes_per_token, num_swap_blocks)


def _memory_budget(config: KVCacheConfig, device: torch.device, activation_bytes: int) -> tuple[int, str]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = device_kv_budget_bytes(total, free, config.gpu_memory_utilization, activation_bytes)
        return budget, "[kv_cache] gpu_memory_utilization"
    return int(config.cpu_kv_space_gb * GIB), "[kv_cache] cpu_kv_space_gb"


def device_kv_budget_bytes(total: int, free: int, utilization: float, reserved_bytes: int) -> int:
    """The KV pool's share of a device: `utilization` of its memory, less what is in use now
    (weights, the CUDA context, other processes) and `reserved_bytes` (the largest step's
    activations, the sampler's temporaries, the CUDA graphs' pool); never negative."""
    in_use = total - free
    return max(int(total * utilization) - in_use - reserved_bytes, 0)
