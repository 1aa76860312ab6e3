"""The greedy pick kernel (engine/cpu/csrc/row_argmax.cpp) is torch.argmax(dim=1), to the index.

Cases that break a careless scan: ties (the first maximum wins), NaNs (the first NaN wins, as
torch counts NaN largest), rows of -inf, a maximum in the scalar tail after the last full vector,
fewer rows than threads (rows split into slices, merged in order) and rows with a stride.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.engine.cpu import row_argmax as _row_argmax
from tokenloom.engine.cpu.kernels import load_cpu_kernels

load_cpu_kernels()
ROW_ARGMAX = torch.ops.tokenloom_cpu.row_argmax


def _rows(kind: str, rows: int, vocab: int) -> torch.Tensor:
    torch.manual_seed(rows * 1000 + vocab)
    if kind == "random":
        return torch.randn(rows, vocab)
    if kind == "ties":  # three values only: many equal maxima per row
        return torch.randint(0, 3, (rows, vocab)).float()
    if kind == "nan":
        x = torch.randn(rows, vocab)
        x[:, vocab // 2] = float("nan")
        x[:, vocab - 1] = float("nan")
        x[0, 0] = 1e9  # a huge value before the first NaN still loses to it
        return x
    if kind == "all_minus_inf":
        return torch.full((rows, vocab), -float("inf"))
    if kind == "max_in_tail":
        x = torch.randn(rows, vocab)
        x[:, -1] = 100.0
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "all_minus_inf", "max_in_tail"])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 32005), (64, 4099), (5, 37), (2, 1)])
def test_row_argmax_equals_torch_argmax(kind, rows, vocab):
    logits = _rows(kind, rows, vocab)
    assert torch.equal(ROW_ARGMAX(logits), logits.argmax(dim=1))


def test_row_argmax_reads_rows_through_their_stride():
    wide = torch.randn(6, 9000)
    logits = wide[:, 1000:8000]  # rows 9000 apart, each contiguous
    assert logits.stride() == (9000, 1)
    assert torch.equal(ROW_ARGMAX(logits), logits.argmax(dim=1))


def test_row_argmax_refuses_other_dtypes_with_a_message():
    with pytest.raises(RuntimeError, match="float32"):
        ROW_ARGMAX(torch.randn(2, 10, dtype=torch.float64))


def test_the_sampler_takes_the_kernel_only_where_it_applies():
    logits = torch.randn(4, 300)
    assert torch.equal(_row_argmax(logits), logits.argmax(dim=1))
    transposed = torch.randn(300, 4).t()  # columns not contiguous: torch's argmax
    assert torch.equal(_row_argmax(transposed), transposed.argmax(dim=1))
    half = torch.randn(4, 300).to(torch.bfloat16)
    assert torch.equal(_row_argmax(half), half.argmax(dim=1))
