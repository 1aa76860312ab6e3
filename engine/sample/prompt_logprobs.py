"""Prompt logprobs from the final hidden states of a step's prompt-scoring positions, a slice of
rows at a time.

Raw log-softmax of the model's logits (as the sampler's logprobs, vLLM's default and what
transformers' log-softmax gives): no temperature, penalties or bias. Each slice of rows is turned
into a [slice, vocab] log-softmax, the logprob of the prompt token the row predicts and its top-k,
so the memory this adds is the hidden states of the step's scoring positions plus one slice's
[slice, vocab] logits, whatever the prompt or chunk length (never [tokens, vocab]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenloom.engine.sample.sampler import TokenLogprobs

ROWS_PER_SLICE = 256  # a [256, 152k] float32 log-softmax is 156 MB


@torch.inference_mode()
def prompt_token_logprobs(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    targets: list[int],
    top_k: list[int],
    rows_per_slice: int = ROWS_PER_SLICE,
) -> list[TokenLogprobs]:
    """hidden [R, H]: final hidden states; lm_head: hidden rows -> raw logits; targets[r]: the prompt
    token row r predicts; top_k[r]: how many alternatives row r returns. One TokenLogprobs per row,
    in row order."""
    entries: list[TokenLogprobs] = []
    for begin in range(0, len(targets), rows_per_slice):
        end = min(begin + rows_per_slice, len(targets))
        logprobs = lm_head(hidden[begin:end]).float().log_softmax(dim=1)
        vocab = logprobs.shape[1]
        chosen_ids = torch.tensor(targets[begin:end], dtype=torch.long, device=hidden.device)
        chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
        k = min(max(top_k[begin:end]), vocab)
        top_lp, top_ids = logprobs.topk(k, dim=1)  # k = 0 gives [rows, 0]
        chosen_l, top_lp_l, top_ids_l = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
        for j, row in enumerate(range(begin, end)):
            n = top_k[row]
            entries.append(
                TokenLogprobs(
                    token_id=targets[row], logprob=chosen_l[j], top=list(zip(top_ids_l[j][:n], top_lp_l[j][:n]))
                )
            )
    return entries
