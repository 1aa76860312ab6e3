"""Every value of a 16-bit float type, and a bit-for-bit comparison that allows subnormal flushes."""

from __future__ import annotations

import torch


def every_16_bit_value(dtype: torch.dtype, rows: int) -> torch.Tensor:
    """All 65,536 bit patterns of `dtype` (NaNs, infinities, subnormals, -0), as [rows, 65536 // rows]."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).view(rows, -1)


def assert_same_bits_up_to_subnormal_flush(
    actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, tiny: float
):
    """actual equals expected bit for bit, NaN where it is NaN; where expected is subnormal
    (|x| <= tiny: a subnormal may round up to tiny), actual may instead be zero (a thread that
    flushes subnormals). `inputs` name the failing elements in the message."""
    assert torch.equal(actual.isnan(), expected.isnan())
    subnormal = (expected != 0) & (expected.float().abs() <= tiny)
    assert ((actual[subnormal] == 0) | (actual[subnormal] == expected[subnormal])).all()
    mismatched = (actual.view(torch.int16) != expected.view(torch.int16)) & ~expected.isnan() & ~subnormal
    assert not mismatched.any(), f"{int(mismatched.sum())} inputs differ, e.g. {inputs[mismatched][:5]}"
