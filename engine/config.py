"""tokenloom configuration: one TOML file, parsed once into frozen, validated dataclasses.

Precedence: built-in defaults < config file < env vars named TOKENLOOM_<SECTION>_<KEY>.
`load_config` is the only function that reads the environment; everything downstream gets
the finished, immutable `TokenloomConfig`. Bounds are declared on the fields (`ranged`,
`one_of`) and checked in each section's __post_init__, so a section built by hand or via
`TokenloomConfig.replace` is validated exactly like one read from a file.
"""

import dataclasses
import difflib
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .config_fields import (
    ENV_BOOL_WORDS, ConfigError, check_section, describe, field_specs, one_of, parse_env_value,
    ranged, show,
)

__all__ = [
    "ConfigError", "DatabaseConfig", "KVCacheConfig", "MetricsConfig", "ModelConfig",
    "QuantizationConfig", "QueueConfig", "SamplingDefaults", "SchedulerConfig", "ServerConfig",
    "TokenloomConfig", "load_config",
]

ENV_PREFIX = "TOKENLOOM_"
# Env vars with our prefix that are not config keys: the config path, the admin secret and the
# fault-test hook (engine/fault_injection.py; deliberately not a config key, so no config file
# can switch it on).
RESERVED_ENV_VARS = frozenset({"TOKENLOOM_CONFIG", "TOKENLOOM_API_KEY", "TOKENLOOM_FAULT_INJECT_PROMPT"})


class _Section:
    """Base of the section dataclasses: validate all fields on construction."""

    __slots__ = ()
    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        check_section(self, self.SECTION)
        self._cross_check()

    def _cross_check(self) -> None:
        """Checks spanning several fields; override per section."""


@dataclass(frozen=True, slots=True)
class ServerConfig(_Section):
    SECTION: ClassVar[str] = "server"
    host: str = "127.0.0.1"
    port: int = ranged(8000, 1, 65535)
    api_base: str = "http://127.0.0.1:8000"
    api_key_env: str = "TOKENLOOM_API_KEY"  # name of the env var holding the admin key
    max_body_mb: int = ranged(32, 1, 1024)
    max_queued_jobs: int = ranged(10_000, 0, 100_000_000)  # per project, queued + running; 0 = no limit
    max_file_mb: int = ranged(64, 1, 4096)  # largest POST /v1/files upload (replaces max_body_mb there)
    max_batch_lines: int = ranged(10_000, 1, 10_000_000)  # requests per batch file; <= max_queued_jobs to fit


@dataclass(frozen=True, slots=True)
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"
    name: str = ""  # HF checkpoint dir or hub id; "" = built-in demo model
    served_name: str = ""  # another name clients may use in "model" (like vLLM's --served-model-name)
    tokenizer: str = ""  # "" = same as name
    max_model_len: int = ranged(0, 0, 1_048_576)  # 0 = the model's own limit
    dtype: str = one_of("auto", "auto", "float32", "float16", "bfloat16", "float64")
    device: str = one_of("auto", "auto", "cpu", "cuda")
    attention_backend: str = one_of("auto", "auto", "torch", "triton", "cpu")
    chat_template: str = ""  # Jinja template path; "" = the tokenizer's own
    seed: int = ranged(0, 0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class KVCacheConfig(_Section):
    SECTION: ClassVar[str] = "kv_cache"
    enabled: bool = True  # must stay true; kept so old configs get a clear error, see below
    block_size: int = ranged(16, 1, 256)
    gpu_memory_utilization: float = ranged(0.85, 0, 1, lo_open=True)
    swap_space_gb: float = ranged(4.0, 0, 1024)
    cpu_kv_space_gb: float = ranged(2.0, 0, 1024, lo_open=True)
    num_blocks: int = ranged(0, 0, 10_000_000)  # 0 = size from the memory budget
    enable_prefix_caching: bool = True

    def _cross_check(self) -> None:
        if not self.enabled:
            raise ConfigError(
                "config: kv_cache.enabled = false is not supported: tokenloom always keeps a "
                "paged KV cache, because decoding without one recomputes every earlier token at "
                "each step (quadratic cost); remove the key or set it to true",
                "kv_cache.enabled",
            )


@dataclass(frozen=True, slots=True)
class QuantizationConfig(_Section):
    SECTION: ClassVar[str] = "quantization"
    enabled: bool = False
    method: str = one_of("int8", "int8", "int4", "awq", "gptq")
    int4_type: str = one_of("nf4", "nf4", "fp4")
    calibration_samples: int = ranged(128, 1, 100_000)
    quantize_lm_head: bool = False


@dataclass(frozen=True, slots=True)
class SamplingDefaults(_Section):
    """Defaults for requests that leave a sampling field unset."""

    SECTION: ClassVar[str] = "sampling"
    temperature: float = ranged(0.7, 0, 100)
    top_p: float = ranged(0.9, 0, 1, lo_open=True)
    top_k: int = ranged(0, 0, 1_000_000)  # 0 = disabled
    min_p: float = ranged(0.0, 0, 1)
    max_tokens: int = ranged(1024, 1, 1_048_576)
    repetition_penalty: float = ranged(1.0, 0, 100, lo_open=True)
    presence_penalty: float = ranged(0.0, -2, 2)
    frequency_penalty: float = ranged(0.0, -2, 2)


@dataclass(frozen=True, slots=True)
class SchedulerConfig(_Section):
    SECTION: ClassVar[str] = "scheduler"
    max_num_seqs: int = ranged(64, 1, 4096)
    max_num_batched_tokens: int = ranged(512, 1, 1_048_576)


@dataclass(frozen=True, slots=True)
class MetricsConfig(_Section):
    SECTION: ClassVar[str] = "metrics"
    enable_ttft: bool = True
    enable_tpot: bool = True
    enable_throughput: bool = True


@dataclass(frozen=True, slots=True)
class QueueConfig(_Section):
    SECTION: ClassVar[str] = "queue"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_stream_maxlen: int = ranged(10_000, 1, 10_000_000)
    max_attempts: int = ranged(3, 1, 100)
    lease_s: float = ranged(30.0, 2.0, 3600.0)
    shutdown_timeout_s: float = ranged(30.0, 0.0, 86400.0)


@dataclass(frozen=True, slots=True)
class DatabaseConfig(_Section):
    SECTION: ClassVar[str] = "database"
    url: str = "sqlite:///tokenloom.db"
    retry_s: float = ranged(300.0, 0.0, 86400.0)


@dataclass(frozen=True, slots=True)
class TokenloomConfig:
    """The whole configuration; one attribute per TOML section."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"config: [{name}] must be a {cls.__name__}", name)

    def replace(self, section: str, **changes: Any) -> "TokenloomConfig":
        """Copy with some of one section's keys changed; the new values are validated."""
        _check_keys(section, changes)
        new_section = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **{section: new_section})


# Section name -> dataclass, in file order; derived from the annotations so they cannot drift.
SECTIONS: dict[str, type] = typing.get_type_hints(TokenloomConfig)


def _check_keys(section: str, keys: Mapping[str, Any]) -> None:
    """Reject an unknown section or key with a message listing what is known."""
    if section not in SECTIONS:
        raise ConfigError(
            f"config: unknown section [{section}]; known sections: {', '.join(SECTIONS)}"
        )
    known = field_specs(SECTIONS[section])
    for key in keys:
        if key not in known:
            raise ConfigError(
                f"config: unknown key [{section}] {key}; known keys: {', '.join(known)}",
                f"{section}.{key}",
            )


def _env_table() -> dict[str, tuple[str, str]]:
    """Env var name -> (section, key) for every config key."""
    table: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for key in field_specs(cls):
            var = f"{ENV_PREFIX}{section}_{key}".upper()
            if var in table or var in RESERVED_ENV_VARS:  # e.g. [kv] cache_x vs [kv_cache] x
                raise RuntimeError(f"config: env var {var} would be ambiguous")
            table[var] = (section, key)
    return table


ENV_VARS: dict[str, tuple[str, str]] = _env_table()


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config: config file not found: {os.fspath(path)}") from None
    except OSError as err:
        raise ConfigError(f"config: cannot read {os.fspath(path)}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config: {os.fspath(path)} is not valid TOML: {err}") from None


def _file_values(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Check the file's shape (known sections and keys only) and return {section: {key: value}}."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, table in raw.items():
        if section not in SECTIONS and not isinstance(table, dict):
            raise ConfigError(f"config: top-level key {section} must be inside a [section]; "
                              f"known sections: {', '.join(SECTIONS)}")
        _check_keys(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config: [{section}] must be a table, not {show(table)}", section)
        _check_keys(section, table)
        values[section].update(table)
    return values


def _apply_env(values: dict[str, dict[str, Any]], origin: dict[str, str],
               env: Mapping[str, str]) -> None:
    """Overlay TOKENLOOM_<SECTION>_<KEY> env vars onto `values`, parsed by the key's type."""
    for var, text in env.items():
        if var not in ENV_VARS:
            continue
        section, key = ENV_VARS[var]
        kind, bounds = field_specs(SECTIONS[section])[key]
        try:
            values[section][key] = parse_env_value(kind, text)
        except ValueError:
            allowed = f"one of {ENV_BOOL_WORDS}" if kind == "bool" else describe(kind, bounds)
            raise ConfigError(
                f"config: {var} = {show(text)} is not valid for {section}.{key}: must be {allowed}",
                f"{section}.{key}",
            ) from None
        origin[f"{section}.{key}"] = f"set by {var}"


def _check_unknown_env(env: Mapping[str, str], api_key_env: str) -> None:
    """A TOKENLOOM_* variable that matches no key is almost surely a typo: refuse it."""
    ignored = RESERVED_ENV_VARS | {api_key_env}
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in ENV_VARS and var not in ignored:
            # Compare without the shared prefix, or every name looks "close".
            n = len(ENV_PREFIX)
            close = difflib.get_close_matches(var[n:], [v[n:] for v in ENV_VARS], n=1)
            hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
            raise ConfigError(
                f"config: unknown environment variable {var}{hint}; tokenloom reads "
                f"{ENV_PREFIX}<SECTION>_<KEY> for the keys in config.toml, plus "
                f"{', '.join(sorted(RESERVED_ENV_VARS))}"
            )


def load_config(path: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None) -> TokenloomConfig:
    """Read `path` (None = all defaults), overlay env overrides (None = os.environ), validate."""
    env = os.environ if env is None else env
    raw = {} if path is None else _read_toml(path)
    try:
        values = _file_values(raw)
    except ConfigError as err:
        raise ConfigError(f"{err} (in {os.fspath(path)})", err.key) from None
    # Remember where each non-default value came from, to point at it in errors.
    origin = {f"{s}.{k}": f"in {os.fspath(path)}" for s, table in values.items() for k in table}
    _apply_env(values, origin, env)
    try:
        config = TokenloomConfig(**{name: cls(**values[name]) for name, cls in SECTIONS.items()})
    except ConfigError as err:
        # Say where the bad value came from (file or env var) so it is quick to fix.
        if err.key in origin:
            raise ConfigError(f"{err} ({origin[err.key]})", err.key) from None
        raise
    _check_unknown_env(env, config.server.api_key_env)
    return config
