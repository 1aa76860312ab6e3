"""Run one fixed request set through a fresh engine and measure it: the unit of `tokenloom sweep`
and `tokenloom bench quant`.

Every request arrives at t=0 with `ignore_eos`, so each configuration does exactly the same
work; memory is the peak over the run (CUDA: allocator peak; CPU: the process's peak resident
set, reset before the run), so values of a sweep compare like for like.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloom.engine import Engine, SamplingParams
from tokenloom.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class RequestSet:
    num_requests: int = 32
    prompt_tokens: int = 512
    output_tokens: int = 128
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [[rng.randrange(3, vocab_size) for _ in range(self.prompt_tokens)] for _ in range(self.num_requests)]


@dataclass(slots=True)
class OperatingPoint:
    peak_memory_gib: float
    weight_mib: float
    kv_pool_gib: float
    ttft_p50_s: float
    tpot_p50_s: float
    throughput_tok_s: float  # generated tokens / wall time
    wall_s: float
    preemptions: int
    outputs: list[list[int]]  # generated token ids per request, for agreement checks


def measure(config: EngineConfig, requests: RequestSet) -> OperatingPoint:
    _reset_peak_memory(config)
    # The operating point is these figures: recorded whatever [metrics] says for serving.
    config = config.replace("metrics", enable_ttft=True, enable_tpot=True, enable_throughput=True)
    engine = Engine(config)
    try:
        prompts = requests.prompts(engine.loaded.shape.vocab_size)
        room = engine.max_model_len - requests.prompt_tokens
        if room < requests.output_tokens:
            raise ValueError(
                f"--prompt-tokens {requests.prompt_tokens} + --output-tokens {requests.output_tokens} exceed "
                f"max_model_len {engine.max_model_len}: lower them or raise [model] max_model_len"
            )
        params = SamplingParams(temperature=0.0, max_tokens=requests.output_tokens, ignore_eos=True)
        engine.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        preemptions_before = engine.counters.num_preemptions
        start = time.perf_counter()
        results = engine.generate([*prompts], params)  # a list[str | list[int]], which list[list[int]] is not
        wall = time.perf_counter() - start
        generated = sum(r.num_output_tokens for r in results)
        finished_metrics = []
        for result in results:
            assert result.metrics is not None  # generate() returns finished outputs, and each has its metrics
            finished_metrics.append(result.metrics)
        return OperatingPoint(
            peak_memory_gib=_peak_memory_bytes(engine) / 2**30,
            weight_mib=engine.loaded.weight_bytes / 2**20,
            kv_pool_gib=engine.kv_plan.total_bytes / 2**30,
            ttft_p50_s=_median_present(m.ttft_s for m in finished_metrics),
            tpot_p50_s=_median_present(m.tpot_s for m in finished_metrics),
            throughput_tok_s=generated / wall,
            wall_s=wall,
            preemptions=engine.counters.num_preemptions - preemptions_before,
            outputs=[r.outputs[0].token_ids for r in results],
        )
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _reset_peak_memory(config: EngineConfig) -> None:
    if torch.cuda.is_available() and config.model.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
        return
    clear_refs = Path("/proc/self/clear_refs")
    try:
        clear_refs.write_text("5")  # Linux: reset the process's peak RSS (VmHWM) to its current RSS
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the whole process lifetime


def _peak_memory_bytes(engine: Engine) -> int:
    if engine.loaded.device.type == "cuda":
        return torch.cuda.max_memory_allocated(engine.loaded.device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _median_present(values: Iterable[float | None]) -> float:
    """The median of the figures a request has (a one-token request has no TPOT); NaN where none has it."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else math.nan
