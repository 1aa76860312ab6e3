"""The Triton kernels compile for Hopper (sm_90) as the engine launches them at the supported
models' layouts, with no register spills and within sm_90's shared memory, on a machine without a GPU.

The interpreter runs the kernels' Python semantics in numpy: it forgives what the compiler does not
(a loop-carried value changing type, a non-power-of-two tl.arange) and says nothing of registers or
shared memory. So a subprocess without TRITON_INTERPRET builds each launch with the launchers' own
`*_launch` functions (the engine's tiles, num_warps and argument specialisation) over tensors laid
out as on CUDA (one layer's view of the KV pool, the step tables packed by StepBuffers) and compiles
it with `JITFunction.warmup` against a stand-in sm_90 driver, down to a cubin.

Register spills come from ptxas's own report (TRITON_DUMP_PTXAS_LOG, a fresh TRITON_CACHE_DIR so
ptxas runs for every case): `CompiledKernel.n_spills` and `n_regs` are only filled in when a
kernel is loaded onto a GPU. Shared memory is `compiled.metadata.shared`. The installed triton
compiles: cpu.lock's in CI, cuda.lock's (an older one) on a CUDA machine. Needs triton's NVIDIA
backend (ptxas), not a device; skips with the reason when there is none.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[3]
SM90_MAX_SHARED_BYTES = 227 * 1024  # the most shared memory one block can opt into on sm_90
COMPILE_TIMEOUT_S = 400  # the whole matrix took ~30 s on a busy 2-core machine


@dataclass(frozen=True)
class Layout:
    """One attention layer of a supported model."""

    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


QWEN2_0_5B = Layout("Qwen2-0.5B", 14, 2, 64)  # a GQA group of 7 (not a power of two)
LLAMA_3_8B = Layout("Llama-3.1-8B", 32, 8, 128)
MISTRAL_7B = Layout("Mistral-7B", 32, 8, 128, sliding_window=4096)
PHI_3_MINI = Layout("Phi-3-mini", 32, 32, 96, sliding_window=2047)  # no GQA; head_dim padded to 128
GEMMA_3_1B = Layout("Gemma-3-1B", 4, 1, 256, sliding_window=512)  # its sliding layers
GEMMA_3_1B_GLOBAL = Layout("Gemma-3-1B-global", 4, 1, 256)  # its full-attention layers

# (query tokens, context tokens) per chunk, decodes first. A decode step is padded to a CUDA
# graph's batch size like every graph replay; a prefill step mixes decodes and prefill chunks.
PHASES = {
    "decode": ([(1, 40)] * 5, 8),
    "prefill": ([(1, 40), (1, 17), (300, 300), (37, 100)], None),
}
DEFAULT_BLOCK_SIZE = 16  # config.toml's [kv_cache] block_size


@dataclass(frozen=True)
class Case:
    layout: Layout
    dtype: str
    phase: str
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def name(self) -> str:
        return f"{self.layout.model}/{self.dtype}/{self.phase}/block_size={self.block_size}"


ATTENTION_CASES = [
    *(
        Case(layout, dtype, phase)
        for layout in (QWEN2_0_5B, LLAMA_3_8B)
        for dtype in ("fp32", "bf16", "fp16")
        for phase in PHASES
    ),
    *(
        Case(layout, dtype, phase)
        for layout in (MISTRAL_7B, PHI_3_MINI, GEMMA_3_1B, GEMMA_3_1B_GLOBAL)
        for dtype in ("fp32", "bf16")
        for phase in PHASES
    ),
    # A block size that is not a multiple of 16: block_size is not specialised on, so the same code must compile.
    Case(LLAMA_3_8B, "bf16", "decode", block_size=8),
    Case(LLAMA_3_8B, "fp32", "prefill", block_size=8),
]
KV_WRITE_CASES = [
    Case(QWEN2_0_5B, "fp32", "prefill"),
    Case(LLAMA_3_8B, "bf16", "prefill"),
    Case(GEMMA_3_1B, "fp16", "decode"),
]


def compile_all() -> None:
    """Runs in the subprocess: compile every case for sm_90 and print one JSON line each."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from bench.gpu_variants import variant_key
    from tokenloom.engine.attention.metadata import ChunkContext
    from tokenloom.engine.attention.triton_kv_write import write_kv_launch
    from tokenloom.engine.attention.triton_paged_attention import RUNS_IN_INTERPRETER, paged_attention_launch
    from tokenloom.engine.runner.copy_fence import NoCopyFence
    from tokenloom.engine.runner.step_buffers import StepBuffers, StepLimits

    assert not RUNS_IN_INTERPRETER
    driver.set_active(_Sm90WithoutDevice(GPUTarget("cuda", 90, 32)))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def step(case: Case):
        """One layer's K/V pools, q|k|v out of the fused projection, and the step's CUDA inputs."""
        layout, dtype = case.layout, dtypes[case.dtype]
        chunks, pad_to = PHASES[case.phase]
        contexts, offset = [], 0
        for num_queries, context_len in chunks:
            block_ids = [0] * -(-context_len // case.block_size)
            contexts.append(ChunkContext(offset, num_queries, context_len, block_ids, None))
            offset += num_queries
        # CUDA defaults: 256 sequences, 8,192 tokens a step, a 4,096-token model.
        limits = StepLimits(8192, 256, -(-4096 // case.block_size))
        buffers = StepBuffers(limits, torch.device("cpu"), NoCopyFence(), pin_memory=False)
        inputs = buffers.pack(
            [0] * offset,
            [0] * offset,
            [0] * offset,
            [],
            contexts,
            list(range(len(contexts))),
            num_decodes=sum(1 for n, _ in chunks if n == 1),
            pad_to=pad_to,
        )
        num_tokens = inputs.metadata.slot_mapping.shape[0]  # padding rows included
        # The engine's pool is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; a layer sees a view.
        pool = torch.zeros(2, 2, 64, case.block_size, layout.num_kv_heads, layout.head_dim, dtype=dtype)
        q_size, kv_size = layout.num_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim
        qkv = torch.zeros(num_tokens, q_size + 2 * kv_size, dtype=dtype)
        key = qkv[:, q_size : q_size + kv_size].view(-1, layout.num_kv_heads, layout.head_dim)
        value = qkv[:, q_size + kv_size :].view(-1, layout.num_kv_heads, layout.head_dim)
        query = torch.zeros(num_tokens, layout.num_heads, layout.head_dim, dtype=dtype)  # RoPE's output
        return query, key, value, pool[1, 0], pool[1, 1], inputs.metadata

    usage_by_variant: dict[str, dict[str, int]] = {}

    def report(kind: str, case: Case, launch) -> None:
        # A case whose launch specialises like an earlier one (block_size is not specialised on) is
        # that compiled variant: triton reuses it and ptxas reports nothing new.
        variant = variant_key(launch)
        ptxas_log = io.StringIO()
        with contextlib.redirect_stdout(ptxas_log):
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
        if variant not in usage_by_variant:
            usage_by_variant[variant] = _ptxas_usage(ptxas_log.getvalue())
        usage = usage_by_variant[variant]
        print(
            json.dumps(
                dict(
                    kernel=kind,
                    case=case.name,
                    shared=compiled.metadata.shared,
                    num_warps=compiled.metadata.num_warps,
                    cubin=len(compiled.asm["cubin"]),
                    **usage,
                )
            ),
            flush=True,
        )

    for case in ATTENTION_CASES:
        query, _, _, key_cache, value_cache, metadata = step(case)
        scale = case.layout.head_dim**-0.5
        launch = paged_attention_launch(
            torch.empty_like(query), query, key_cache, value_cache, metadata.tables, scale, case.layout.sliding_window
        )
        report("attention", case, launch)
    for case in KV_WRITE_CASES:
        _, key, value, key_cache, value_cache, metadata = step(case)
        report("kv_write", case, write_kv_launch(key, value, key_cache, value_cache, metadata.slot_mapping))


class _Sm90WithoutDevice:
    """What `JITFunction.warmup` asks of triton's active driver, answered for an sm_90 that is not there."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def _ptxas_usage(log: str) -> dict[str, int]:
    """Registers and spill bytes from ptxas's -v report (triton runs ptxas with -v)."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas report (TRITON_DUMP_PTXAS_LOG=1 and an empty TRITON_CACHE_DIR?): {log!r}")
    return dict(registers=int(registers[1]), spill_stores=int(spills[1]), spill_loads=int(spills[2]))


def _ptxas_missing_reason() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as error:  # no NVIDIA backend, or no ptxas where triton looks
        return f"triton has no ptxas for sm_90 here ({type(error).__name__}: {error})"
    return None if Path(path).is_file() else f"triton's ptxas for sm_90 is not at {path}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, dict]:
    """Every case compiled once, in one subprocess: {"kernel case": figures}."""
    reason = _ptxas_missing_reason()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= dict(
        TRITON_DEFAULT_FP_FUSION="1",  # triton 3.9's default, stated to silence its warning
        TRITON_DUMP_PTXAS_LOG="1",
        TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")),  # cold: ptxas reports every case
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.engine.attention.test_triton_compile"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"compiling for sm_90 took over {COMPILE_TIMEOUT_S} s; done so far:\n{error.stdout}")
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print(
        "\n".join(
            f"{r['kernel']:9} {r['case']:45} warps {r['num_warps']}  shared {r['shared']:6}  "
            f"registers {r['registers']:3}  spill stores/loads {r['spill_stores']}/{r['spill_loads']}"
            for r in results
        )
    )
    return {f"{r['kernel']} {r['case']}": r for r in results}


def test_every_launch_compiles_to_a_cubin_for_sm90(compiled):
    expected = {f"attention {c.name}" for c in ATTENTION_CASES} | {f"kv_write {c.name}" for c in KV_WRITE_CASES}
    assert set(compiled) == expected
    assert all(r["cubin"] > 0 for r in compiled.values())


def test_no_launch_spills_registers_on_sm90(compiled):
    spilling = {
        name: (r["registers"], r["spill_stores"], r["spill_loads"])
        for name, r in compiled.items()
        if r["spill_stores"] or r["spill_loads"]
    }
    assert not spilling, f"(registers, spill store bytes, spill load bytes): {spilling}; see attention_tile()"


def test_every_launch_fits_sm90_shared_memory(compiled):
    too_big = {name: r["shared"] for name, r in compiled.items() if r["shared"] > SM90_MAX_SHARED_BYTES}
    assert not too_big, f"shared memory bytes over sm_90's {SM90_MAX_SHARED_BYTES}: {too_big}"


if __name__ == "__main__":
    compile_all()
