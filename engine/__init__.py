"""tokenloom's engine: continuous batching over one paged KV pool, exact against transformers.

The inference library alone; the applications built on it (the OpenAI wire format in
tokenloom.openai_protocol, `tokenloom run` and sweeps in tokenloom.offline, the queue's worker, the
API) live above it and use this module's names. The folders are its parts, each importing only
those below it (pyproject.toml's import-linter contracts hold the order):

    loop/                      the step (schedule -> forward -> sample -> outputs) and its host thread
    inputs/  outputs/          prompts to token ids; token ids to results, stops, logprobs
    runner/                    one packed forward pass on the device (graphs, buffers, memory)
    core/                      scheduler, sequences, KV blocks (plain Python, no torch)
    models/  attention/  cpu/  sample/  structured_output/
    config/  testing/          validated config sections; the fault-injection test hook

The engine takes its configuration as arguments (EngineConfig, a FaultInjector) and reads no
tokenloom setting from the environment; the settings do. What it does read there is the machine's
own conventions: where caches go (XDG_CACHE_HOME, TORCH_EXTENSIONS_DIR) and the CPU kernels' target
instruction set (TOKENLOOM_CPU_ISA, a build-time choice like -march; docs/backends.md).

Names load on first use, so `import tokenloom.engine.config` (the settings do) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> "module" (the same name there) or "module:name" (exported under another name)
_EXPORTS = {
    # the engine and its host thread
    "Engine": "tokenloom.engine.loop.engine",
    "EngineHost": "tokenloom.engine.loop.engine_host",
    "EngineConfig": "tokenloom.engine.config",
    "default_cache_dir": "tokenloom.engine.config.cache_dir",
    # requests in
    "SamplingParams": "tokenloom.engine.sample.sampling_params",
    "InvalidRequestError": "tokenloom.engine.sample.sampling_params",
    "SAMPLING_BOUNDS": "tokenloom.engine.sample.bounds",
    "LOGIT_BIAS_BOUND": "tokenloom.engine.sample.bounds",
    "STRUCTURED_OUTPUT_FIELDS": "tokenloom.engine.structured_output.spec:REQUEST_FIELDS",
    "constraint_from_request": "tokenloom.engine.structured_output.spec",
    "PromptEncoder": "tokenloom.engine.inputs.tokenization",
    "fit_to_context": "tokenloom.engine.inputs.context_fit",
    # results out
    "RequestOutput": "tokenloom.engine.outputs.outputs",
    "CompletionOutput": "tokenloom.engine.outputs.outputs",
    "TokenLogprobs": "tokenloom.engine.sample.sampler",
    "TokenSpeller": "tokenloom.engine.outputs.logprob_tokens",
    "speller_for": "tokenloom.engine.outputs.logprob_tokens",
    "finite": "tokenloom.engine.outputs.logprob_tokens",
    "compact_prompt_logprobs": "tokenloom.engine.outputs.compact_prompt_logprobs",
    "expand_prompt_logprobs": "tokenloom.engine.outputs.compact_prompt_logprobs",
    "EngineCounters": "tokenloom.engine.core.counters",
    # models and start-up failures
    "demo_model": "tokenloom.engine.models.demo.choice",
    "load_hf_config": "tokenloom.engine.models.loader",
    "resolve_checkpoint": "tokenloom.engine.models.loader",
    "ModelLoadError": "tokenloom.engine.models.loader",
    "UnsupportedModelError": "tokenloom.engine.models.architectures",
    "KVCacheTooSmallError": "tokenloom.engine.runner.kv_plan",
    # the fault-injection test hook (armed from the environment by the settings, never by the engine)
    "FaultInjector": "tokenloom.engine.testing.fault_injection",
    "STALL_STEP_S": "tokenloom.engine.testing.fault_injection",
    # the C++ CPU kernels' one-time build (`tokenloom build-kernels`)
    "load_cpu_kernels": "tokenloom.engine.cpu.kernels",
    "kernel_library_path": "tokenloom.engine.cpu.kernels",
    "CpuKernelsUnavailable": "tokenloom.engine.cpu.kernels",
    "target_isa": "tokenloom.engine.cpu.instruction_set",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from tokenloom.engine.config import EngineConfig
    from tokenloom.engine.config.cache_dir import default_cache_dir
    from tokenloom.engine.core.counters import EngineCounters
    from tokenloom.engine.cpu.instruction_set import target_isa
    from tokenloom.engine.cpu.kernels import CpuKernelsUnavailable, kernel_library_path, load_cpu_kernels
    from tokenloom.engine.inputs.context_fit import fit_to_context
    from tokenloom.engine.inputs.tokenization import PromptEncoder
    from tokenloom.engine.loop.engine import Engine
    from tokenloom.engine.loop.engine_host import EngineHost
    from tokenloom.engine.models.architectures import UnsupportedModelError
    from tokenloom.engine.models.demo.choice import demo_model
    from tokenloom.engine.models.loader import ModelLoadError, load_hf_config, resolve_checkpoint
    from tokenloom.engine.outputs.compact_prompt_logprobs import compact_prompt_logprobs, expand_prompt_logprobs
    from tokenloom.engine.outputs.logprob_tokens import TokenSpeller, finite, speller_for
    from tokenloom.engine.outputs.outputs import CompletionOutput, RequestOutput
    from tokenloom.engine.runner.kv_plan import KVCacheTooSmallError
    from tokenloom.engine.sample.bounds import LOGIT_BIAS_BOUND, SAMPLING_BOUNDS
    from tokenloom.engine.sample.sampler import TokenLogprobs
    from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams
    from tokenloom.engine.structured_output.spec import REQUEST_FIELDS as STRUCTURED_OUTPUT_FIELDS
    from tokenloom.engine.structured_output.spec import constraint_from_request
    from tokenloom.engine.testing.fault_injection import STALL_STEP_S, FaultInjector


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'tokenloom.engine' has no attribute {name!r}")
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value  # later lookups skip this function
    return value
