"""tokenloom's engine: continuous batching over one paged KV pool, exact against transformers.

The folders are its parts, each importing only those below it (pyproject.toml's import-linter
contracts hold the order):

    offline/  tuning/          applications of the engine: `tokenloom run`, sweeps
    openai/                    the OpenAI wire format every entry point shares
    engine_host.py             one engine on its own thread, for the worker and `tokenloom run`
    engine.py                  the step: schedule -> forward -> sample -> outputs
    inputs/  outputs/          prompts to token ids; token ids to results, stops, logprobs
    runner/                    one packed forward pass on the device (graphs, buffers, memory)
    core/  sample/             scheduler, sequences, KV blocks (no torch); sampling
    models/  attention/  cpu/  structured_output/
    config.py  config_fields.py

This module is the surface the API, the worker and the store use (another contract says so). Its
names load on first use, so `import tokenloom.engine.config` (the settings do) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "Engine": "tokenloom.engine.engine",
    "EngineHost": "tokenloom.engine.engine_host",
    "EngineConfig": "tokenloom.engine.config",
    "SamplingParams": "tokenloom.engine.sample.sampling_params",
    "InvalidRequestError": "tokenloom.engine.sample.sampling_params",
    "TokenLogprobs": "tokenloom.engine.sample.sampler",
    "RequestOutput": "tokenloom.engine.outputs.outputs",
    "TokenSpeller": "tokenloom.engine.outputs.logprob_tokens",
    "speller_for": "tokenloom.engine.outputs.logprob_tokens",
    "default_cache_dir": "tokenloom.engine.cache_dir",
    "KVCacheTooSmallError": "tokenloom.engine.runner.kv_plan",
    "ModelLoadError": "tokenloom.engine.models.loader",
    "load_hf_config": "tokenloom.engine.models.loader",
    "resolve_checkpoint": "tokenloom.engine.models.loader",
    "UnsupportedModelError": "tokenloom.engine.models.architectures",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from tokenloom.engine.config import EngineConfig
    from tokenloom.engine.engine import Engine
    from tokenloom.engine.engine_host import EngineHost
    from tokenloom.engine.models.architectures import UnsupportedModelError
    from tokenloom.engine.models.loader import ModelLoadError, load_hf_config, resolve_checkpoint
    from tokenloom.engine.outputs.logprob_tokens import TokenSpeller, speller_for
    from tokenloom.engine.outputs.outputs import RequestOutput
    from tokenloom.engine.runner.kv_plan import KVCacheTooSmallError
    from tokenloom.engine.cache_dir import default_cache_dir
    from tokenloom.engine.sample.sampler import TokenLogprobs
    from tokenloom.engine.sample.sampling_params import InvalidRequestError, SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenloom.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
