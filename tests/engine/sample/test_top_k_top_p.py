"""Top-k / top-p filtering that sorts only the candidates equals the full-vocabulary sort it
replaced: the same tokens survive, with the same logits, for every mix of (top_k, top_p) rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenloom.engine.sample.top_k_top_p import apply_top_k_top_p, candidate_width

VOCAB = 300
TOP_KS = [0, 1, 2, 7, 50, VOCAB - 1, VOCAB, VOCAB + 5]
TOP_PS = [1.0, 0.999, 0.9, 0.5, 0.1, 1e-6]


def full_sort_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The sampler's filtering before candidates: sort every row over the whole vocabulary."""
    num_rows, vocab = logits.shape
    use_top_k = any(0 < k < vocab for k in top_k)
    use_top_p = any(p < 1.0 for p in top_p)
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)
    if use_top_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k]).unsqueeze(1)
        pos = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(pos >= k, float("-inf"))
    if use_top_p:
        p = torch.tensor(top_p, dtype=torch.float32).unsqueeze(1)
        sorted_probs = sorted_logits.softmax(dim=1)
        mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
        drop = (mass_before >= p) & (p < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


@pytest.mark.parametrize("seed", range(4))
def test_every_single_row_combination_keeps_the_same_tokens_as_the_full_sort(seed):
    generator = torch.Generator().manual_seed(seed)
    combos = list(itertools.product(TOP_KS, TOP_PS))
    logits = torch.randn(len(combos), VOCAB, generator=generator) * (1 + seed)  # distinct values: no ties
    for row, (k, p) in enumerate(combos):
        one = logits[row : row + 1]
        assert torch.equal(apply_top_k_top_p(one, [k], [p]), full_sort_reference(one, [k], [p])), (k, p)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_mixing_filters_keep_the_same_tokens_as_the_full_sort(seed):
    generator = torch.Generator().manual_seed(100 + seed)
    num_rows = 1 + seed % 9
    picks = torch.randint(0, len(TOP_KS) * len(TOP_PS), (num_rows,), generator=generator).tolist()
    top_k = [TOP_KS[i % len(TOP_KS)] for i in picks]
    top_p = [TOP_PS[i // len(TOP_KS)] for i in picks]
    if seed % 2:  # half the batches have top-k on every top-p row: the candidates-only path
        top_k = [k if 0 < k < VOCAB or p == 1.0 else 40 for k, p in zip(top_k, top_p)]
    logits = torch.randn(num_rows, VOCAB, generator=generator) * 3
    logits[0, :5] = float("-inf")  # tokens a constraint or min_tokens already removed
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), full_sort_reference(logits, top_k, top_p)), (
        top_k,
        top_p,
    )


def test_with_ties_at_the_top_k_boundary_exactly_k_of_the_highest_tokens_survive():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 2.0]])
    kept = apply_top_k_top_p(logits, [3], [1.0])
    reference = full_sort_reference(logits, [3], [1.0])
    assert torch.isfinite(kept).sum() == torch.isfinite(reference).sum() == 3
    assert sorted(kept[torch.isfinite(kept)].tolist()) == sorted(reference[torch.isfinite(reference)].tolist())


def test_rows_without_filters_come_back_unchanged_beside_top_k_rows():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    out = apply_top_k_top_p(logits, [0, 3], [1.0, 1.0])
    assert torch.equal(out[0], logits[0]) and int(torch.isfinite(out[1]).sum()) == 3


def test_no_filter_returns_the_logits_themselves():
    logits = torch.randn(3, VOCAB)
    assert apply_top_k_top_p(logits, [0, VOCAB, -1], [1.0, 1.0, 1.0]) is logits


def test_candidates_reach_the_largest_top_k_unless_a_row_filters_by_top_p_alone():
    assert candidate_width([5, 40, 100], [1.0, 0.9, 1.0], 100) == 40
    assert candidate_width([5, 100], [1.0, 0.9], 100) == 100  # top-p without top-k: the whole vocabulary
    assert candidate_width([100], [1.0], 100) == 100
