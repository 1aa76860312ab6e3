"""The configuration of a CLI command: --config, plus the engine flags users know from `vllm serve`.

Each engine flag sets one config key exactly as its TOKENLOOM_<SECTION>_<KEY> variable does (it
is applied as that variable, over the process environment), so a flag, the variable and the
config file parse and validate the same way, and a bad value names the flag.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CONFIG_HELP = "config file (default: $TOKENLOOM_CONFIG, else ./config.toml if it exists, else built-in defaults)"
# Environment variables the CLI reads itself; they are no config keys, so load_config never sees them.
CLI_ENV_VARS = ("TOKENLOOM_LOG_FORMAT",)


@dataclass(frozen=True, slots=True)
class EngineFlag:
    flag: str
    env_var: str  # the config key it sets, as its environment variable
    help: str
    type: type = str
    choices: tuple[str, ...] | None = None


ENGINE_FLAGS = (
    EngineFlag(
        "--model",
        "TOKENLOOM_MODEL_NAME",
        "a Hugging Face hub id, a checkpoint directory or a .gguf file ([model] name; default: the demo model)",
    ),
    EngineFlag(
        "--max-model-len",
        "TOKENLOOM_MODEL_MAX_MODEL_LEN",
        "longest prompt + output in tokens ([model] max_model_len; 0 = the model's own)",
        int,
    ),
    EngineFlag(
        "--dtype",
        "TOKENLOOM_MODEL_DTYPE",
        "weights and activations dtype ([model] dtype)",
        choices=("auto", "float32", "float16", "bfloat16", "float64"),
    ),
    EngineFlag(
        "--device", "TOKENLOOM_MODEL_DEVICE", "where the engine runs ([model] device)", choices=("auto", "cpu", "cuda")
    ),
    EngineFlag(
        "--gpu-memory-utilization",
        "TOKENLOOM_KV_CACHE_GPU_MEMORY_UTILIZATION",
        "fraction of GPU memory for weights + KV cache ([kv_cache] gpu_memory_utilization)",
        float,
    ),
)
QUANTIZATION_CHOICES = ("none", "int8", "int4", "awq", "gptq")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help=CONFIG_HELP)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and the engine flags, for the commands that load or name a model."""
    add_config_argument(parser)
    group = parser.add_argument_group("engine (each flag overrides its config key)")
    for spec in ENGINE_FLAGS:
        group.add_argument(
            spec.flag,
            type=spec.type,
            choices=spec.choices,
            help=spec.help,
            metavar=None if spec.choices else spec.flag.lstrip("-").split("-")[-1].upper(),
        )
    group.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="weight quantization ([quantization] enabled + method; none = off)",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and --model only, for the commands that name a model's queue without loading it."""
    add_config_argument(parser)
    [model] = [spec for spec in ENGINE_FLAGS if spec.flag == "--model"]
    parser.add_argument(model.flag, metavar="MODEL", help=model.help)


def flag_overrides(args: argparse.Namespace) -> dict[str, str]:
    """Env var -> value for every engine flag given on the command line."""
    overrides = {}
    for spec in ENGINE_FLAGS:
        value = getattr(args, spec.flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            overrides[spec.env_var] = str(value)
    quantization = getattr(args, "quantization", None)
    if quantization == "none":
        overrides["TOKENLOOM_QUANTIZATION_ENABLED"] = "false"
    elif quantization is not None:
        overrides.update(TOKENLOOM_QUANTIZATION_ENABLED="true", TOKENLOOM_QUANTIZATION_METHOD=quantization)
    return overrides


def config_path(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    if os.environ.get("TOKENLOOM_CONFIG"):
        return os.environ["TOKENLOOM_CONFIG"]
    return "config.toml" if Path("config.toml").is_file() else None


def load_cli_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None):
    """The command's TokenloomConfig: file < environment < flags. A bad flag value names the flag."""
    from tokenloom.settings.config import ConfigError, load_config

    overrides = flag_overrides(args)
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k not in CLI_ENV_VARS} | overrides
    try:
        return load_config(config_path(getattr(args, "config", None)), env=env)
    except ConfigError as err:
        message = str(err)
        for spec in ENGINE_FLAGS:
            if spec.env_var in overrides:
                message = message.replace(spec.env_var, spec.flag)
        if "TOKENLOOM_QUANTIZATION_" in message and getattr(args, "quantization", None):
            message = message.replace("TOKENLOOM_QUANTIZATION_METHOD", "--quantization")
        raise ConfigError(message, err.key) from None
