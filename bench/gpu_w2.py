"""W2 offline throughput (../shared/design/BENCHMARKS.md) on a random model of Qwen2.5-0.5B's shape:
tokenloom with CUDA graphs on and off vs transformers `generate` (static batches) and
transformers' continuous batching (`generate_batch`), same prompts, dtype and device.

Static batches of W2 run each batch to its longest output; a batch is timed as a whole, and when
the budget runs out the rate is that of the batches that finished (each batch is independent, so
this is a measured rate on the first part of W2, said so in the JSON). All systems ignore EOS.

Each tokenloom engine is warmed up on W2's own first prompts before the timed run, so the steps the
run takes (multi-chunk prefills, prefill chunks beside decodes, decode-only steps) have compiled
their kernels and captured their graphs outside the timing. Each system's row reaches the
section's record the moment it is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from bench.gpu_decode import SHAPES, checkpoint, free_device_memory, sync_device
from bench.peers import left_padded
from bench.workloads import BenchRequest, w2_offline_large
from tokenloom.engine.config import EngineConfig
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

WARMUP_REQUESTS = 32  # W2's first prompts (100-1024 tokens): several chunks per prefill step, with decodes beside
WARMUP_TOKENS = 8  # enough decode-only steps after the prefills


def engine_config(path, requests: list[BenchRequest], device: str, dtype: str, enforce_eager: bool) -> EngineConfig:
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    return load_config(None, env={}).replace(
        "model", name=str(path), dtype=dtype, device=device, max_model_len=longest, enforce_eager=enforce_eager
    )


def warmup_requests(requests: list[BenchRequest]) -> list[BenchRequest]:
    """W2's first prompts with few output tokens: the step shapes of the timed run, in a few steps."""
    return [dataclasses.replace(r, max_tokens=WARMUP_TOKENS) for r in requests[:WARMUP_REQUESTS]]


def run_tokenloom(path, requests: list[BenchRequest], device: str, dtype: str, enforce_eager: bool) -> dict:
    engine = Engine(engine_config(path, requests, device, dtype, enforce_eager))
    warmup = warmup_requests(requests)
    engine.generate(
        [r.prompt_token_ids for r in warmup],
        [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in warmup],
    )
    engine.counters.__init__()
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    sync_device(device)
    start = time.perf_counter()
    outputs = engine.generate([r.prompt_token_ids for r in requests], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    c = engine.counters
    result = {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "graphs": engine.runner.graphs is not None,
        "graphs_plan": engine.graph_plan.describe(),
        "steps": c.num_steps,
        "mean_batch_seqs": c.mean_batch_seqs,
        "preemptions": c.num_preemptions,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "startup_report": engine.startup_report,
    }
    del engine
    free_device_memory(device)
    return result


@torch.inference_mode()
def run_hf_static(model, requests: list[BenchRequest], batch_size: int, device: str, budget_s: float) -> dict:
    """Left-padded static batches in input order until `budget_s` is spent."""
    done_tokens, done_requests, wall = 0, 0, 0.0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        ids, mask = left_padded(batch)
        new_tokens = max(r.max_tokens for r in batch)
        sync_device(device)
        began = time.perf_counter()
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        sync_device(device)
        wall += time.perf_counter() - began
        done_tokens += sum(r.max_tokens for r in batch)  # only the tokens each request asked for count
        done_requests += len(batch)
        if wall > budget_s:
            break
    return {
        "wall_s": wall,
        "output_tokens": done_tokens,
        "output_tok_s": done_tokens / wall,
        "requests_run": done_requests,
        "complete": done_requests == len(requests),
    }


def run_hf_continuous(model, requests: list[BenchRequest], device: str) -> dict:
    """transformers' continuous batching over all of W2; only the tokens each request asked for count,
    and a request that generate_batch failed fails the system. Not under inference mode: generate_batch
    runs its loop in a thread of its own, which cannot update tensors made under this thread's
    inference mode (every request then fails)."""
    new_tokens = max(r.max_tokens for r in requests)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    sync_device(device)
    # On a GPU transformers sizes its cache from free memory, as it would for any user; on a CPU
    # (the rehearsal) that would be most of the machine's memory, so it gets what W2 needs.
    num_blocks = None if device != "cpu" else sum(-(-(len(r.prompt_token_ids) + new_tokens) // 16) for r in requests)
    cb_config = continuous_batching_config(page_size=16, max_batch_tokens=8192, num_blocks=num_blocks)
    with host_memory_figures():
        start = time.perf_counter()
        results = model.generate_batch(
            inputs=[r.prompt_token_ids for r in requests],
            generation_config=config,
            continuous_batching_config=cb_config,
        )
        sync_device(device)
        wall = time.perf_counter() - start
    tokens = asked_for_tokens(requests, results)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "note": "every request ran to the longest max_tokens (one GenerationConfig); only asked-for tokens count",
    }


def asked_for_tokens(requests: list[BenchRequest], results: dict) -> int:
    """Tokens generate_batch produced within each request's max_tokens; raises if a request failed
    or came back short (its results: request id -> output, in input order)."""
    outputs = list(results.values())
    if len(outputs) != len(requests):
        raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(requests)} requests")
    failed = [o for o in outputs if getattr(o, "error", None)]
    if failed:
        raise RuntimeError(f"generate_batch failed {len(failed)} of {len(requests)} requests: {failed[0].error}")
    short = [i for i, (r, o) in enumerate(zip(requests, outputs)) if len(o.generated_tokens) < r.max_tokens]
    if short:
        raise RuntimeError(f"generate_batch returned fewer tokens than asked for {len(short)} requests")
    return sum(r.max_tokens for r in requests)


@contextlib.contextmanager
def host_memory_figures() -> Iterator[None]:
    """transformers sizes generate_batch's KV cache from the free memory it finds: CUDA's own figures
    on a GPU, psutil's on a CPU. Without psutil (the device image has none: it runs on CUDA) it
    finds 0 bytes on a CPU and refuses to start, so the CPU rehearsal reads the same figures
    (physical memory, this process's resident set) from the kernel instead."""
    try:
        cache = importlib.import_module("transformers.generation.continuous_batching.cache")
    except ImportError:
        yield
        return
    original = getattr(cache, "get_device_and_memory_breakdown", None)
    if original is None:
        yield
        return

    def breakdown():
        device, total, reserved, allocated = original()
        if device.type != "cpu" or total:
            return device, total, reserved, allocated
        page = os.sysconf("SC_PAGE_SIZE")
        resident = int(Path("/proc/self/statm").read_text().split()[1]) * page
        return device, os.sysconf("SC_PHYS_PAGES") * page, resident, resident

    cache.get_device_and_memory_breakdown = breakdown
    try:
        yield
    finally:
        cache.get_device_and_memory_breakdown = original


def continuous_batching_config(
    page_size: int, max_batch_tokens: int, num_blocks: int | None = None
) -> ContinuousBatchingConfig:
    """transformers' continuous-batching config under either name of its KV page size: `block_size`
    in 5.17 (the device's), `page_size` in later releases (which keep `block_size` as an alias).
    `num_blocks` None: transformers sizes the cache from the memory it finds free."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    name = "page_size" if "page_size" in fields else "block_size"
    return ContinuousBatchingConfig(**{name: page_size}, max_batch_tokens=max_batch_tokens, num_blocks=num_blocks)


def run(result: dict, device: str, smoke: bool = False, peer_budget_s: float = 90.0) -> None:
    """Fills `result` as systems finish, so a section cut short by its budget keeps what ran."""
    shape, dtype = ("tiny", "float32") if smoke else ("0.5b", "bfloat16")
    path = checkpoint(shape, getattr(torch, dtype), device)
    vocab = SHAPES[shape]["vocab_size"]
    requests = w2_offline_large(vocab, num_requests=8, min_len=8, max_len=24) if smoke else w2_offline_large(vocab)
    result["workload"] = {
        "requests": len(requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "shape": shape,
        "dtype": dtype,
    }
    systems: dict[str, dict] = {}

    def record(name: str, row: dict, label: str) -> None:
        systems[name] = row
        result["systems"] = systems  # set on the section's result: a RecordedResult saves it now
        print(f"W2 {label}: {row['output_tok_s']:,.0f} tok/s", flush=True)

    record("tokenloom", run_tokenloom(path, requests, device, dtype, enforce_eager=False), "tokenloom")
    record("tokenloom-eager", run_tokenloom(path, requests, device, dtype, enforce_eager=True), "tokenloom eager")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    record("hf-static-64", run_hf_static(model, requests, 64, device, peer_budget_s), "transformers static 64")
    ours = systems["tokenloom"]["output_tok_s"]
    result["tokenloom_vs_hf_static"] = ours / systems["hf-static-64"]["output_tok_s"]
    record("hf-generate-batch", run_hf_continuous(model, requests, device), "transformers generate_batch")
    result["tokenloom_vs_hf_generate_batch"] = ours / systems["hf-generate-batch"]["output_tok_s"]
