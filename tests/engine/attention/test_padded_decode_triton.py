"""Decode steps packed by the CUDA step buffers and padded to a graph's batch size, run through
the real Triton kernels (triton's CPU interpreter without a GPU): the step's own rows equal the
torch reference on the unpadded step, and the padding rows write no KV slot."""

from __future__ import annotations

import pytest
import torch

from tests.engine.attention.test_triton_kernels import make_step
from tests.engine.triton_support import DEVICE, require_kernel_runtime
from tokenloom.engine.attention.torch_backend import TorchAttentionBackend
from tokenloom.engine.attention.triton_backend import TritonAttentionBackend
from tokenloom.engine.runner.copy_fence import NoCopyFence
from tokenloom.engine.runner.step_buffers import StepBuffers, StepLimits

require_kernel_runtime()


@pytest.mark.parametrize("pad_to", [5, 8])
def test_padded_decode_rows_match_the_reference_and_padding_writes_nothing(pad_to):
    step = make_step([(9, 1), (17, 1), (1, 1), (40, 1), (16, 1)], 8, 2, 32, block_size=16, seed=pad_to)
    meta = step.metadata
    num_rows = len(meta.chunks)
    buffers = StepBuffers(
        StepLimits(max_num_tokens=16, max_num_seqs=8, max_blocks_per_seq=4), DEVICE, NoCopyFence(), pin_memory=False
    )
    inputs = buffers.pack(
        list(range(num_rows)),
        [c.context_len - 1 for c in meta.chunks],
        meta.slot_mapping.tolist(),
        list(range(num_rows)),
        meta.chunks,
        list(range(num_rows)),
        num_decodes=num_rows,
        pad_to=pad_to,
    )
    extra = pad_to - num_rows

    def padded(x):  # padding rows carry arbitrary activations: they must still write and affect nothing
        return torch.cat([x, torch.full((extra, *x.shape[1:]), 7.0, dtype=x.dtype, device=x.device)])

    scale = 32**-0.5
    reference_caches = step.key_cache.clone(), step.value_cache.clone()
    expected = TorchAttentionBackend().forward(step.query, step.key, step.value, *reference_caches, meta, scale, None)
    actual = TritonAttentionBackend().forward(
        padded(step.query),
        padded(step.key),
        padded(step.value),
        step.key_cache,
        step.value_cache,
        inputs.metadata,
        scale,
        None,
    )
    assert actual.shape[0] == pad_to
    torch.testing.assert_close(actual[:num_rows], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(step.key_cache, reference_caches[0]) and torch.equal(step.value_cache, reference_caches[1])
