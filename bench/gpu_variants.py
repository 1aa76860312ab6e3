"""The Triton kernel variants the device check compiles, section by section, held to its budgets.

Triton compiles a kernel once per specialisation key: its constexpr arguments and launch options
(the tile), the dtypes of its pointers, and a class per integer argument and pointer (equal to 1,
a multiple of 16, other; 16-byte aligned or not) unless the kernel opts out, as ours do for the
values that change from step to step (engine/attention/triton_paged_attention.py). A first-time
compile costs seconds of a section's budget; a variant an earlier section compiled is read back
from triton's disk cache, which every section's process shares.

`section_launches` builds the launches each section makes on the device, through the engine's own
code on CPU tensors laid out as on CUDA: the section's own checkpoints (the 0.5B shape with one
layer and a small vocabulary: the attention layout is what counts) and engine configs, run through
the start-up memory profile, the CUDA-graph capture of every batch size, and eager steps of every
kind (a long prefill, several chunks beside decodes, decode-only steps of 1, 3, 16, 17 and
max_num_seqs sequences, padded as the runner pads them); the kernels section's own steps. Nothing
runs: the launches are recorded. `variant_keys` gives each launch the key triton caches its
compile under, taken from triton's own binder against an sm_90 target with no GPU present.

    python -m bench.gpu_variants            # per section: first-time compiles, and what the budget allows
    python -m bench.gpu_variants --compile  # also compile one launch per variant for sm_90 (ptxas, no GPU)

The kernels section is compile-bound by design (3 layouts x 3 dtypes x 2 tiles), so on the device
it compiles its variants in parallel processes first (`precompile`), into the disk cache its own
launches then read.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenloom.engine.attention.kernel_launch import KernelLaunch

# The device's compute capability as triton targets it (H100 and H200 are both 9.0).
SM90 = (9, 0)
# First-time compiles a section may spend: SECONDS_PER_COMPILE each, at most COMPILE_SHARE of its
# budget. One variant of these kernels compiled for sm_90 in 1.2-1.7 s on this project's 2-core
# machines (tests/engine/attention/test_triton_compile.py's matrix); the device's host is taken to
# be no faster per compile.
SECONDS_PER_COMPILE = 2.0
COMPILE_SHARE = 0.5
# Parallel precompile (the kernels section): processes, and what starting them costs (importing torch).
PRECOMPILE_WORKERS = 8
PRECOMPILE_START_S = 8.0
PRECOMPILED_SECTIONS = frozenset({"kernels"})


@dataclass(frozen=True, slots=True)
class EngineCase:
    """One engine a section starts: its checkpoint (build_random_checkpoint's arguments) and its config."""

    name: str
    checkpoint: dict
    config: object  # a function (checkpoint path) -> EngineConfig, the section's own
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True, slots=True)
class KernelCase:
    """One case of bench/gpu_kernels.py: a packed step through the Triton backend."""

    name: str
    layout: tuple[int, int, int]  # query heads, KV heads, head_dim
    dtype: torch.dtype
    step: tuple[tuple[int, int], ...]  # (context length, query tokens) per chunk
    seed: int


@dataclass(slots=True)
class SectionVariants:
    """What one section compiles: every variant it launches, and those no earlier section compiled."""

    section: str
    variants: dict[str, set[str]] = field(default_factory=dict)  # kernel -> keys
    first_time: dict[str, set[str]] = field(default_factory=dict)

    @property
    def num_first_time(self) -> int:
        return sum(len(keys) for keys in self.first_time.values())


# ---------------------------------------------------------------------------------------------
# The check's cases, from the sections' own tables


def kernel_cases(smoke: bool) -> list[KernelCase]:
    from bench import gpu_kernels

    layouts = {"tiny": (4, 2, 32)} if smoke else gpu_kernels.HEAD_LAYOUTS
    dtypes = {"float32": torch.float32} if smoke else gpu_kernels.DTYPES
    steps = {
        "mixed": gpu_kernels.SMOKE_STEP if smoke else gpu_kernels.FULL_STEP,
        "decode": gpu_kernels.SMOKE_DECODE_STEP if smoke else gpu_kernels.DECODE_STEP,
    }
    return [
        KernelCase(f"{name}/{dtype_name}/{kind}", layout, dtype, tuple(shape), layout[2] + layout[0])
        for name, layout in layouts.items()
        for dtype_name, dtype in dtypes.items()
        for kind, shape in steps.items()
    ]


def oracle_cases(
    newer: bool, only_families: list[str] | None = None, only_scenarios: list[str] | None = None
) -> list[EngineCase]:
    from bench import gpu_oracle

    families, scenarios = gpu_oracle.selected_cases(False, newer, only_families, only_scenarios)
    cases = [
        EngineCase(
            f"{family}/{scenario}",
            _oracle_checkpoint(gpu_oracle, family),
            _oracle_config(gpu_oracle, sections, "float32", False),
        )
        for family in families
        for scenario, sections in scenarios.items()
    ]
    if newer and only_families is None:
        sections = {"scheduler": dict(max_num_seqs=gpu_oracle.GRAPH_CASE_BATCH, max_num_batched_tokens=512)}
        checkpoint = _oracle_checkpoint(gpu_oracle, gpu_oracle.GRAPH_CASE_FAMILY)
        cases += [
            EngineCase(
                f"{gpu_oracle.GRAPH_CASE_FAMILY}/bfloat16/{'eager' if eager else 'graphs'}",
                checkpoint,
                _oracle_config(gpu_oracle, sections, "bfloat16", eager),
                torch.bfloat16,
            )
            for eager in (False, True)
        ]
    return cases


def _oracle_checkpoint(gpu_oracle, family: str) -> dict:
    return dict(
        max_position_embeddings=256, initializer_range=0.1, **(gpu_oracle.NEWER_FAMILIES | gpu_oracle.FAMILIES)[family]
    )


def _oracle_config(gpu_oracle, sections: dict, dtype: str, eager: bool):
    return lambda path: gpu_oracle.engine_config(path, "cuda", "triton", sections, dtype=dtype, enforce_eager=eager)


def _mini_0_5b() -> dict:
    """bench/gpu_decode.py's 0.5B shape with one layer, a narrow MLP and a small vocabulary: the same
    attention layout (hidden 896, 14 query / 2 KV heads, head_dim 64) at a fraction of the build."""
    from bench.gpu_decode import SHAPES

    return dict(
        SHAPES["0.5b"], architecture="LlamaForCausalLM", num_hidden_layers=1, intermediate_size=64, vocab_size=384
    )


def decode_cases() -> list[EngineCase]:
    from bench import gpu_decode
    from bench.gpu_check import decode_argv

    args = gpu_decode.parse(decode_argv("cuda", smoke=False))
    return [
        EngineCase(
            f"0.5b/{system}",
            _mini_0_5b(),
            lambda path, s=system: gpu_decode.engine_config(path, args, s),
            getattr(torch, args.dtype),
        )
        for system in args.backends
    ]


def w2_cases() -> list[EngineCase]:
    from bench import gpu_w2
    from bench.gpu_decode import SHAPES
    from bench.workloads import w2_offline_large

    requests = w2_offline_large(SHAPES["0.5b"]["vocab_size"])
    return [
        EngineCase(
            f"0.5b/{'eager' if eager else 'graphs'}",
            _mini_0_5b(),
            lambda path, e=eager: gpu_w2.engine_config(path, requests, "cuda", "bfloat16", e),
            torch.bfloat16,
        )
        for eager in (False, True)
    ]


def section_cases(section: str) -> list[KernelCase | EngineCase]:
    """The cases whose launches a section of bench/gpu_check.py makes on the device."""
    if section == "smoke":
        return [*kernel_cases(smoke=True), *oracle_cases(False, ["llama"], ["chunked_prefill"])]
    if section == "kernels":
        return list(kernel_cases(smoke=False))
    if section in ("oracle", "oracle_newer"):
        return list(oracle_cases(newer=section == "oracle_newer"))
    if section == "decode":
        return list(decode_cases())
    if section == "w2":
        return list(w2_cases())
    raise ValueError(f"unknown section {section!r}")


# ---------------------------------------------------------------------------------------------
# Launches, recorded instead of run


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[KernelLaunch]]:
    """Every KernelLaunch run inside is appended to the yielded list and not run; attention's
    output is zeroed so the model's later ops see numbers, not uninitialised memory."""
    from tokenloom.engine.attention.triton_paged_attention import _paged_attention_kernel

    recorded: list[KernelLaunch] = []
    original = KernelLaunch.run

    def record(launch: KernelLaunch) -> None:
        recorded.append(launch)
        if launch.kernel is _paged_attention_kernel:
            launch.args[0].zero_()

    KernelLaunch.run = record
    try:
        yield recorded
    finally:
        KernelLaunch.run = original


def case_launches(case: KernelCase | EngineCase, root: Path) -> list[KernelLaunch]:
    if isinstance(case, KernelCase):
        return _kernel_case_launches(case)
    return _engine_case_launches(case, root)


def _kernel_case_launches(case: KernelCase) -> list[KernelLaunch]:
    from tests.engine.attention.triton_steps import make_step
    from tokenloom.engine.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, head_dim = case.layout
    step = make_step(list(case.step), heads, kv_heads, head_dim, block_size=16, dtype=case.dtype, seed=case.seed)
    with recorded_launches() as launches:  # what assert_triton_matches_reference runs
        TritonAttentionBackend().forward(
            step.query, step.key, step.value, step.key_cache, step.value_cache, step.metadata, head_dim**-0.5, None
        )
    return launches


def _engine_case_launches(case: EngineCase, root: Path) -> list[KernelLaunch]:
    """The launches of a CUDA engine of this config: start-up profile, graph capture, eager steps."""
    from tokenloom.engine.attention.triton_backend import TritonAttentionBackend
    from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
    from tokenloom.engine.models.loader import load_hf_config, load_model
    from tokenloom.engine.models.moe import experts_sync_reason, grouped_mm_is_sync_free
    from tokenloom.engine.runner.cuda_graphs import plan_graphs
    from tokenloom.engine.runner.memory_profile import ProfiledSpan, largest_decode_step, largest_step, run_profile_step

    digest = hashlib.sha1(json.dumps(case.checkpoint, sort_keys=True).encode()).hexdigest()[:12]
    path = root / f"{case.checkpoint['architecture']}-{digest}"
    if not (path / "config.json").is_file():
        build_random_checkpoint(path, **case.checkpoint)
    config = case.config(path)
    cpu = torch.device("cpu")
    model, _ = load_model(path, load_hf_config(path), case.dtype, cpu)
    scheduler = config.scheduler.resolved_for("cuda")
    max_model_len = config.model.max_model_len or model.shape.max_position_embeddings
    block_size = config.kv_cache.block_size
    blocker = (
        None
        if model.shape.moe is None
        else experts_sync_reason(case.dtype, SM90, grouped_mm_is_sync_free(case.dtype, SM90))
    )
    plan = plan_graphs(torch.device("cuda"), "triton", config.model.enforce_eager, scheduler.max_num_seqs, blocker)
    backend = TritonAttentionBackend()
    with recorded_launches() as launches:
        # Start-up (engine/runner/memory_profile.py). Step sizes never enter a key (only whether a
        # chunk has more than one query token), so the largest step is cut to 1,024 tokens here.
        eager = largest_step(min(scheduler.max_num_batched_tokens, 1024), max_model_len, scheduler.max_num_seqs)
        run_profile_step(model, backend, eager, block_size, cpu, case.dtype)
        if plan.enabled:
            run_profile_step(
                model,
                backend,
                largest_decode_step(plan.batch_sizes[-1]),
                block_size,
                cpu,
                case.dtype,
                ProfiledSpan.GRAPH_BODY,
            )
        _run_steps(model, backend, plan, scheduler, max_model_len, block_size, case.dtype)
    return launches


def _run_steps(model, backend, plan, scheduler, max_model_len: int, block_size: int, dtype: torch.dtype) -> None:
    """The graph capture of every bucket and the eager steps, through the CUDA step buffers."""
    from tokenloom.engine.runner.copy_fence import NoCopyFence
    from tokenloom.engine.runner.cuda_graphs import DecodeGraphs
    from tokenloom.engine.runner.model_runner import ModelRunner
    from tokenloom.engine.runner.step_buffers import StepBuffers, StepLimits

    cpu = torch.device("cpu")
    runner = ModelRunner(model, 4, block_size, backend, cpu, dtype)  # the engine's pool layout, few blocks
    limits = StepLimits(
        max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs),
        scheduler.max_num_seqs,
        -(-max_model_len // block_size),
    )  # as the engine sizes them
    buffers = StepBuffers(limits, cpu, NoCopyFence(), pin_memory=False)
    graphs = DecodeGraphs(plan, buffers)
    for batch_size in sorted(plan.batch_sizes, reverse=True):  # DecodeGraphs.capture's inputs
        inputs = buffers.pack([], [], [], [], [], [], 0, pad_to=batch_size)
        model.hidden_states(
            inputs.input_ids,
            inputs.positions,
            runner.kv_caches,
            graphs._static_metadata(batch_size),
            backend,
            inputs.sample_indices,
        )
    budget = scheduler.max_num_batched_tokens
    prefill, chunk = min(max_model_len - 1, budget, 64), max(1, min(12, (budget - 3) // 2))
    steps = [[(prefill, prefill)], [(9, 1), (33, 1), (17, 1), (28 + chunk, chunk), (chunk, chunk)]]
    if not plan.enabled:  # with graphs these replay; eagerly, the chunk count varies with the batch
        steps += [
            [(5 + i, 1) for i in range(n)]
            for n in sorted({1, 3, 16, 17, scheduler.max_num_seqs})
            if n <= scheduler.max_num_seqs
        ]
    for chunks in steps:
        inputs = _pack(buffers, chunks, block_size)
        model.hidden_states(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata, backend, inputs.sample_indices
        )


def _pack(buffers, chunks: list[tuple[int, int]], block_size: int):
    """One step of (context length, query tokens) chunks, each sequence in blocks of its own."""
    from tokenloom.engine.attention.metadata import ChunkContext

    token_ids, positions, slots, samples, contexts, next_block = [], [], [], [], [], 0
    for context_len, num_queries in chunks:
        blocks = list(range(next_block, next_block + -(-context_len // block_size)))
        next_block += len(blocks)
        start = context_len - num_queries
        contexts.append(ChunkContext(len(token_ids), num_queries, context_len, blocks, None))
        token_ids += [0] * num_queries
        positions += list(range(start, context_len))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, context_len)]
        samples.append(len(token_ids) - 1)
    num_decodes = sum(1 for _, n in chunks if n == 1)
    return buffers.pack(token_ids, positions, slots, samples, contexts, list(range(len(chunks))), num_decodes)


# ---------------------------------------------------------------------------------------------
# Keys and compiles, against an sm_90 that is not there


class StandInDriver:
    """What triton's JIT asks of its active driver to specialise and compile, answered for a CUDA
    target that is not present (tests/engine/attention/test_triton_compile.py uses the same)."""

    def __init__(self, capability: tuple[int, int]):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def activate_stand_in(capability: tuple[int, int] = SM90) -> None:
    """Make triton specialise and compile for `capability` in this process (no GPU, no interpreter)."""
    from triton.runtime.driver import driver

    from tokenloom.engine.attention.triton_paged_attention import RUNS_IN_INTERPRETER

    if RUNS_IN_INTERPRETER:
        raise RuntimeError("TRITON_INTERPRET=1: the interpreter compiles nothing; run without it")
    driver.set_active(StandInDriver(capability))


def variant_key(launch: KernelLaunch) -> str:
    """The key triton caches this launch's compile under (its binder's specialisation and options)."""
    binder = launch.kernel.device_caches[0][-1]
    _, specialization, options = binder(*launch.args, **launch.options)
    return f"{specialization}|{sorted(options.items())}"


def kernel_name(launch: KernelLaunch) -> str:
    return launch.kernel.fn.__name__.strip("_").removesuffix("_kernel")


def section_variants(sections: list[str], root: Path) -> list[SectionVariants]:
    """Each section's variants, in run order; `first_time`: those no earlier section compiled."""
    seen: dict[str, set[str]] = {}
    results = []
    for section in sections:
        result = SectionVariants(section)
        for case in section_cases(section):
            for launch in case_launches(case, root):
                result.variants.setdefault(kernel_name(launch), set()).add(variant_key(launch))
        for kernel, keys in result.variants.items():
            result.first_time[kernel] = keys - seen.get(kernel, set())
            seen.setdefault(kernel, set()).update(keys)
        results.append(result)
    return results


def compile_seconds(section: str, num_first_time: int) -> float:
    """Seconds of the section's budget its first-time compiles take on the device."""
    if section in PRECOMPILED_SECTIONS and num_first_time:
        return PRECOMPILE_START_S + math.ceil(num_first_time / PRECOMPILE_WORKERS) * SECONDS_PER_COMPILE
    return num_first_time * SECONDS_PER_COMPILE


def compile_allowance_s(budget_s: float) -> float:
    return budget_s * COMPILE_SHARE


def compile_one_per_variant(sections: list[str], root: Path) -> dict[str, int]:
    """Compile (for the stand-in target) one launch per distinct key; per kernel, the entries in
    triton's own in-memory cache afterwards, which must equal the distinct keys."""
    done: dict[tuple[str, str], KernelLaunch] = {}
    for section in sections:
        for case in section_cases(section):
            for launch in case_launches(case, root):
                done.setdefault((kernel_name(launch), variant_key(launch)), launch)
    kernels = {}
    for launch in done.values():
        launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
        kernels[kernel_name(launch)] = launch.kernel
    return {name: len(kernel.device_caches[0][0]) for name, kernel in kernels.items()}


# ---------------------------------------------------------------------------------------------
# Parallel precompile, on the device


def precompile(section: str, capability: tuple[int, int], workers: int = PRECOMPILE_WORKERS) -> dict:
    """Compile the section's cases in `workers` fresh processes (a stand-in driver each: no CUDA
    context), into triton's disk cache, where the section's own launches then find them. Returns
    what it did; never raises (a failure only costs the time the serial compiles would have)."""
    start = time.perf_counter()
    cases = section_cases(section)
    shares = [list(range(i, len(cases), workers)) for i in range(min(workers, len(cases)))]
    try:
        with multiprocessing.get_context("spawn").Pool(len(shares)) as pool:
            compiled = sum(pool.starmap(_compile_cases, [(section, share, capability) for share in shares]))
    except Exception as err:  # recorded by the caller; the section compiles as it goes instead
        return {"precompiled": 0, "error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - start}
    return {"precompiled": compiled, "workers": len(shares), "seconds": round(time.perf_counter() - start, 1)}


def _compile_cases(section: str, indices: list[int], capability: tuple[int, int]) -> int:
    activate_stand_in(capability)
    cases = section_cases(section)
    compiled = 0
    with tempfile.TemporaryDirectory() as root:
        for index in indices:
            for launch in case_launches(cases[index], Path(root)):
                launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
                compiled += 1
    return compiled


def main(argv=None) -> int:
    from bench.gpu_check import SECTIONS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=[s.name for s in SECTIONS])
    parser.add_argument("--compile", action="store_true", help="compile one launch per variant for sm_90")
    args = parser.parse_args(argv)
    activate_stand_in()
    budgets = {s.name: s.budget_s for s in SECTIONS}
    with tempfile.TemporaryDirectory() as root:
        for result in section_variants(args.sections, Path(root)):
            seconds = compile_seconds(result.section, result.num_first_time)
            print(
                json.dumps(
                    {
                        "section": result.section,
                        "variants": {k: len(v) for k, v in sorted(result.variants.items())},
                        "first_time": {k: len(v) for k, v in sorted(result.first_time.items())},
                        "compile_s": seconds,
                        "allowed_s": compile_allowance_s(budgets[result.section]),
                    }
                ),
                flush=True,
            )
        if args.compile:
            print(json.dumps({"compiled": compile_one_per_variant(args.sections, Path(root))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
