"""Triton kernels vs the torch reference backend on CUDA, at real models' head layouts and dtypes.

Each case is one packed step of decodes (short and long contexts) and prefill chunks over
cached prefixes, in a pool of shuffled blocks, built by the kernel tests' own step maker; the
Triton backend's output and KV writes are compared with the torch reference's.
"""

from __future__ import annotations

import itertools

import torch

# Query heads, KV heads, head_dim.
HEAD_LAYOUTS = {
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen3-0.6b": (16, 8, 128),
    "llama-3-8b": (32, 8, 128),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# (context length after the step, query tokens): decodes up to 2k context, a fresh 512-token
# prompt, and chunks over long cached prefixes.
FULL_STEP = [(1, 1), (17, 1), (300, 1), (2048, 1), (512, 512), (1500, 256), (4096, 64)] + [(129, 1)] * 24
SMOKE_STEP = [(1, 1), (17, 1), (40, 8)]
# Decodes only: the step every CUDA-graph replay runs, which takes the decode-only tile.
DECODE_STEP = [(1, 1), (17, 1), (300, 1), (2048, 1), (4096, 1)] + [(129, 1)] * 59
SMOKE_DECODE_STEP = [(1, 1), (17, 1), (33, 1)]


def run(smoke: bool = False, progress: dict | None = None) -> dict:
    """`progress`: gets `cases` after each case (a RecordedResult saves it, so a killed run keeps them)."""
    from tests.engine.attention.test_triton_kernels import assert_triton_matches_reference, make_step

    layouts = {"tiny": (4, 2, 32)} if smoke else HEAD_LAYOUTS
    dtypes = {"float32": torch.float32} if smoke else DTYPES
    cases, failures = [], 0
    steps = {"mixed": SMOKE_STEP if smoke else FULL_STEP, "decode": SMOKE_DECODE_STEP if smoke else DECODE_STEP}
    for name, (num_heads, num_kv_heads, head_dim) in layouts.items():
        for (dtype_name, dtype), (kind, shape) in itertools.product(dtypes.items(), steps.items()):
            step = make_step(
                shape, num_heads, num_kv_heads, head_dim, block_size=16, dtype=dtype, seed=head_dim + num_heads
            )
            case = {"layout": name, "dtype": dtype_name, "step": kind, "heads": [num_heads, num_kv_heads, head_dim]}
            try:
                assert_triton_matches_reference(step, tolerance=TOLERANCE[dtype])
                case["equal"] = True
            except AssertionError as err:
                failures += 1
                case.update(equal=False, error=str(err)[:600])
            cases.append(case)
            if progress is not None:
                progress["cases"] = cases
            print(f"kernels {name} {dtype_name} {kind}: {'equal' if case['equal'] else 'DIFFERENT'}", flush=True)
    return {"cases": cases, "all_equal": failures == 0}
