"""Host lists and tensors sent to the sampler's device: off CUDA, exactly what torch builds
directly (no pinned memory is asked for; it needs a CUDA driver)."""

from __future__ import annotations

import torch

from tokenloom.engine.sample.pinned_copy import list_to_device, tensor_to_device

CPU = torch.device("cpu")


def test_a_list_becomes_a_tensor_of_the_asked_dtype_without_pinning_off_cuda():
    out = list_to_device([3, 1, 2], torch.long, CPU)
    assert out.dtype == torch.long and out.tolist() == [3, 1, 2] and not out.is_pinned()
    assert list_to_device([0.5, 2.0], torch.float32, CPU).dtype == torch.float32
    assert list_to_device([True, False], torch.bool, CPU).tolist() == [True, False]


def test_a_host_tensor_off_cuda_is_returned_as_it_is():
    mask = torch.tensor([[1, 2]], dtype=torch.int32)
    assert tensor_to_device(mask, CPU) is mask
