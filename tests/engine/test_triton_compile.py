"""The Triton kernels compile for a real GPU target (sm_90, down to a cubin), with no GPU present.

The interpreter runs the kernels' Python semantics in numpy and forgives what the compiler does
not (a loop-carried value changing type, a non-power-of-two tl.arange, an unsupported dtype mix),
so this test builds the configurations the engine launches through triton's own compiler in a
subprocess without TRITON_INTERPRET. It needs triton's NVIDIA backend (its bundled ptxas), not a
device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (dtype, head_dim, group, max_query_len, sliding window): shapes of supported models, both tile
# choices, the fp32 "ieee" dot, padded head_dim (80 -> 128), a GQA group of 7 (Qwen2-0.5B).
ATTENTION_CASES = [
    ("bf16", 64, 7, 1, False),
    ("bf16", 64, 7, 128, False),
    ("fp16", 80, 4, 128, True),
    ("fp32", 32, 2, 1, True),
    ("bf16", 128, 8, 128, False),
]
KV_WRITE_CASES = [("bf16", 2, 64), ("fp32", 1, 48), ("fp16", 8, 128)]


def compile_all() -> None:
    """Runs in the subprocess: compile every case for sm_90 and print one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from tokenloom.engine.attention import triton_paged_attention as attention
    from tokenloom.engine.attention.triton_kv_write import _write_kv_kernel

    assert not attention.RUNS_IN_INTERPRETER
    target = GPUTarget("cuda", 90, 32)

    def build(kernel, pointer_types: dict[str, str], constants: dict) -> int:
        signature = {
            name: "constexpr" if name in constants else pointer_types.get(name, "i32") for name in kernel.arg_names
        }
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=target)
        return len(compiled.asm["cubin"])

    for dtype, head_dim, group, max_query_len, window in ATTENTION_CASES:
        block_m, block_q = attention._query_tile(group, max_query_len)
        head_dim_p = max(16, triton.next_power_of_2(head_dim))
        pointers = {name: f"*{dtype}" for name in ("out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr")}
        pointers |= {"block_table_ptr": "*i32", "query_start_ptr": "*i32", "context_lens_ptr": "*i32", "scale_log2": "fp32"}
        constants = dict(
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
            TILE_N=64 if head_dim_p <= 128 else 32, USE_WINDOW=window,
            DOT_PRECISION="ieee" if dtype == "fp32" else None, UPCAST_DOT=False,
        )
        if max_query_len == 1:
            constants["num_chunks"] = 1  # triton passes an int argument equal to 1 as a constant
        print("attention", dtype, head_dim, group, max_query_len, window, build(attention._paged_attention_kernel, pointers, constants))
    for dtype, num_kv_heads, head_dim in KV_WRITE_CASES:
        pointers = {name: f"*{dtype}" for name in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
        pointers["slot_mapping_ptr"] = "*i64"
        constants = dict(
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            NUM_KV_HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        )
        print("kv_write", dtype, num_kv_heads, head_dim, build(_write_kv_kernel, pointers, constants))


def _has_nvidia_compiler() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


def test_kernels_compile_for_sm90_without_a_gpu():
    if not _has_nvidia_compiler():
        pytest.skip("this triton install has no NVIDIA backend (ptxas) to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, stated to silence its warning
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.test_triton_compile"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert len(lines) == len(ATTENTION_CASES) + len(KV_WRITE_CASES), done.stdout
    assert all(int(line.split()[-1]) > 0 for line in lines), done.stdout  # a non-empty cubin each


if __name__ == "__main__":
    compile_all()
