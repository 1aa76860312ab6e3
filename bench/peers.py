"""The transformers peers of BENCHMARKS.md: static-batch `generate` and `generate_batch`."""

from __future__ import annotations

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from bench.workloads import BenchRequest


@torch.inference_mode()
def left_padded(batch: list[BenchRequest], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of a batch, prompts aligned to the right as `generate` expects."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        n = len(request.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - n :] = 1
    return ids, mask


def hf_generate_static(model, requests: list[BenchRequest], batch_size: int, pad_token_id: int = 0) -> int:
    """Left-padded static batches in input order; every request in a batch runs to the batch's
    longest output (EOS is suppressed via min_new_tokens). Returns the tokens the requests asked for."""
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        ids, mask = left_padded(batch, pad_token_id)
        new_tokens = max(r.max_tokens for r in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_token_id,
        )
    return sum(r.max_tokens for r in requests)


@torch.inference_mode()
def hf_generate_batch(model, requests: list[BenchRequest], max_batch_tokens: int = 512) -> int:
    """transformers' own continuous batching (paged, page_size 16)."""
    new_tokens = max(r.max_tokens for r in requests)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.generate_batch(
        inputs=[r.prompt_token_ids for r in requests],
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, max_batch_tokens=max_batch_tokens),
    )
    return sum(r.max_tokens for r in requests)
