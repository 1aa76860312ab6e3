"""How much GPU memory one step's activations take, measured before the KV pool is sized.

vLLM's approach: after the weights are loaded, run a forward pass of the largest step the
scheduler can plan (max_num_batched_tokens prompt tokens) on a throw-away pool, then sample its
logits the most expensive way a request can ask for (top-k, top-p, a repetition penalty, 20
logprobs), read the CUDA allocator's peak, and leave that much free when the KV pool takes the
rest of `gpu_memory_utilization`. Without it the pool would take memory the first big step
needs, and that step would fail with "CUDA out of memory".
"""

from __future__ import annotations

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.runner.model_runner import ModelRunner
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.sample.sampler import Sampler, SamplingRow
from tokenloom.engine.sample.sampling_params import SamplingParams

# The costliest sampling a request can ask for: a sort (top-k/top-p), a seen-token mask
# (repetition penalty) and the most logprobs an API accepts.
_WORST_CASE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=20)


def peak_step_activation_bytes(model: DecoderModel, backend, num_tokens: int, block_size: int,
                               device: torch.device, dtype: torch.dtype, num_sampled: int | None = None,
                               with_sampler: bool = True) -> int:
    """Peak bytes allocated above the current level by one prefill of `num_tokens` whose last
    `num_sampled` positions (default: all) are sampled (CUDA only; 0 elsewhere)."""
    if device.type != "cuda":
        return 0
    num_sampled = num_tokens if num_sampled is None else min(num_sampled, num_tokens)
    num_blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, num_blocks, block_size, backend, device, dtype)
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    positions = torch.arange(num_tokens, device=device)
    metadata = AttentionMetadata(
        slot_mapping=positions.clone(), num_decodes=0,
        chunks=[ChunkContext(0, num_tokens, num_tokens, list(range(num_blocks)), 0)],
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = runner.model(ids, positions, runner.kv_caches, metadata, backend, positions[-num_sampled:])
        if with_sampler:
            rows = [SamplingRow(i, _WORST_CASE_PARAMS, [0], 1) for i in range(num_sampled)]
            Sampler(device).sample(logits.float(), rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del runner, logits
    torch.cuda.empty_cache()
    return max(peak, 0)
