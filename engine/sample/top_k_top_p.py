"""Top-k and top-p (nucleus) filtering of a batch of logits rows, sorting only what they can keep.

Semantics (per row): top-k keeps the k highest logits; top-p then keeps the shortest run of the
remaining tokens, highest first, whose probability (renormalised over what top-k kept) reaches p,
always at least the top token; everything else becomes -inf. Ties at a boundary are kept or
dropped in the order the sort returns them, so exactly k tokens survive top-k.

Why not sort the whole vocabulary: a row can only keep tokens among its k best, so when every row
that uses top-p also has a top-k, the rows need sorting only as far as the largest k
(`torch.topk`): a few dozen candidates instead of a 150K-token vocabulary. Only a row with top-p
and no top-k needs the full sort, and then the batch takes it. Rows with neither filter come back
unchanged.
"""

from __future__ import annotations

import torch

from tokenloom.engine.sample.pinned_copy import list_to_device


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`logits` [R, V] with each row's tokens outside its top-k / top-p at -inf (a new tensor, or
    `logits` itself when no row filters). `top_k[r]` of 0 or >= V and `top_p[r]` of 1.0 disable them."""
    num_rows, vocab = logits.shape
    device = logits.device
    ks = [k if 0 < k < vocab else vocab for k in top_k]  # vocab: no top-k
    use_top_k = any(k < vocab for k in ks)
    use_top_p = any(p < 1.0 for p in top_p)
    if not (use_top_k or use_top_p):
        return logits
    width = candidate_width(ks, top_p, vocab)
    if width == vocab:
        candidates, candidate_ids = logits.sort(dim=1, descending=True)  # [R, V] each
    else:
        candidates, candidate_ids = logits.topk(width, dim=1)  # [R, W] each, highest first
    if use_top_k:
        k = list_to_device(ks, torch.long, device).unsqueeze(1)  # [R, 1]
        position = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
        candidates = candidates.masked_fill(position >= k, float("-inf"))
    if use_top_p:
        p = list_to_device(top_p, torch.float32, device).unsqueeze(1)  # [R, 1]
        probs = candidates.softmax(dim=1)  # [R, W]
        # Probability mass strictly before each position; position 0 always has 0.
        mass_before = probs.cumsum(dim=1) - probs  # [R, W]
        drop = (mass_before >= p) & (p < 1.0)
        drop[:, 0] = False  # always keep the top token
        candidates = candidates.masked_fill(drop, float("-inf"))
    # Every token that is not a candidate is dropped (when the candidates are the whole row, none is).
    base = torch.empty_like(logits) if width == vocab else torch.full_like(logits, float("-inf"))
    filtered = base.scatter_(1, candidate_ids, candidates)  # [R, V]
    unfiltered_rows = [k == vocab and p >= 1.0 for k, p in zip(ks, top_p)]
    if width < vocab and any(unfiltered_rows):  # their tokens beyond the candidates must stay
        keep = list_to_device(unfiltered_rows, torch.bool, device).unsqueeze(1)  # [R, 1]
        filtered = torch.where(keep, logits, filtered)
    return filtered


def candidate_width(top_k: list[int], top_p: list[float], vocab: int) -> int:
    """How many of each row's highest logits the filters can keep: the largest top-k (each
    `top_k[r]` already in 1..vocab, vocab meaning none), or the whole vocabulary when a row
    filters by top-p alone."""
    if any(p < 1.0 and k == vocab for k, p in zip(top_k, top_p)):
        return vocab
    return max((k for k in top_k if k < vocab), default=vocab)
