"""Log-likelihood of a fixed text under an engine's model: one prefill through the engine's own
runner and decoder, logits at every position. For a fresh engine only (it writes pool blocks
0..n without allocating them), which is how the quantization tests use it."""

from __future__ import annotations

import torch

from tokenloom.engine.attention.metadata import AttentionMetadata, ChunkContext
from tokenloom.engine.loop.engine import Engine


def mean_logprob(engine: Engine, token_ids: list[int]) -> float:
    """Mean log-probability of token_ids[1:] given the tokens before each, teacher-forced."""
    runner = engine.runner
    n, block_size = len(token_ids), runner.block_size
    blocks = list(range(-(-n // block_size)))
    assert len(blocks) <= engine.kv_plan.num_blocks and not engine.has_unfinished_requests
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n, device=runner.device),
        num_decodes=0,
        chunks=[ChunkContext(0, n, n, blocks, 0)],
    )
    ids = torch.tensor(token_ids, device=runner.device)
    with torch.inference_mode():
        logits = runner.model(
            ids,
            torch.arange(n, device=runner.device),
            runner.kv_caches,
            metadata,
            runner.backend,
            torch.arange(n - 1, device=runner.device),
        ).float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])
    return logprobs.mean().item()
