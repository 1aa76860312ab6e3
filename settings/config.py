"""tokenloom's whole configuration: one TOML file, parsed once into frozen, validated dataclasses.

Precedence: built-in defaults < config file < env vars named TOKENLOOM_<SECTION>_<KEY>.
`load_config` is the only function that reads the environment; everything downstream gets
the finished, immutable `TokenloomConfig`: the engine's sections (tokenloom.engine.config,
which the engine takes on its own) plus the service's [server], [queue] and [database].
"""

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenloom.engine.config import (
    ConfigError,
    ConfigSection,
    EngineConfig,
    KVCacheConfig,
    MetricsConfig,
    ModelConfig,
    QuantizationConfig,
    SamplingDefaults,
    SchedulerConfig,
    check_section_keys,
)
from tokenloom.engine.config.fields import describe, field_specs, ranged, show
from tokenloom.openai_protocol.scoring_limit import DEFAULT_MAX_PROMPT_LOGPROB_ENTRIES as DEFAULT_PROMPT_LOGPROBS
from tokenloom.settings.text_values import BOOL_WORDS as ENV_BOOL_WORDS
from tokenloom.settings.text_values import parse_text_value

__all__ = [
    "ConfigError",
    "DatabaseConfig",
    "KVCacheConfig",
    "MetricsConfig",
    "ModelConfig",
    "QuantizationConfig",
    "QueueConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "ServerConfig",
    "TokenloomConfig",
    "load_config",
]

ENV_PREFIX = "TOKENLOOM_"
# Env vars with our prefix that are not config keys: the config path, the admin secret and the
# fault-test hook (engine/testing/fault_injection.py; deliberately not a config key, so no config file
# can switch it on).
RESERVED_ENV_VARS = frozenset(
    {
        "TOKENLOOM_CONFIG",
        "TOKENLOOM_API_KEY",
        "TOKENLOOM_FAULT_INJECT_PROMPT",
        "TOKENLOOM_LOG_FORMAT",
        "TOKENLOOM_CPU_ISA",
    }
)


@dataclass(frozen=True, slots=True)
class ServerConfig(ConfigSection):
    SECTION: ClassVar[str] = "server"
    host: str = "127.0.0.1"
    port: int = ranged(8000, 1, 65535)
    api_base: str = "http://127.0.0.1:8000"
    api_key_env: str = "TOKENLOOM_API_KEY"  # name of the env var holding the admin key
    max_body_mb: int = ranged(32, 1, 1024)
    # Admission per class of work (docs/priority.md): a project's queued + running jobs of the limit's classes.
    max_queued_jobs: int = ranged(100_000, 0, 100_000_000)  # per project: chat, completions, /v1/jobs; 0 = no limit
    max_queued_batch_lines: int = ranged(1_000_000, 0, 1_000_000_000)  # per project: batch lines; 0 = no limit
    max_file_mb: int = ranged(200, 1, 4096)  # largest POST /v1/files upload (OpenAI's batch file limit)
    max_batch_lines: int = ranged(50_000, 1, 10_000_000)  # lines per batch file (OpenAI's); <= max_queued_batch_lines
    strict_fields: bool = False  # refuse (400) request fields tokenloom does not define, instead of ignoring them
    # Prompt logprob entries one request may ask for (openai_protocol/scoring_limit.py); config.toml describes it.
    max_prompt_logprob_entries: int = ranged(DEFAULT_PROMPT_LOGPROBS, 1, 10**9)


@dataclass(frozen=True, slots=True)
class QueueConfig(ConfigSection):
    SECTION: ClassVar[str] = "queue"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_stream_maxlen: int = ranged(10_000, 1, 10_000_000)
    max_attempts: int = ranged(3, 1, 100)
    lease_s: float = ranged(30.0, 2.0, 3600.0)
    shutdown_timeout_s: float = ranged(30.0, 0.0, 86400.0)
    group_size: int = ranged(32, 1, 4096)  # jobs per queue message for batches; a worker claims a group at once
    # Claim room each of jobs and batch lines is guaranteed, a fraction of the window (docs/priority.md).
    min_claim_share: float = ranged(0.1, 0.0, 0.5)


@dataclass(frozen=True, slots=True)
class DatabaseConfig(ConfigSection):
    SECTION: ClassVar[str] = "database"
    url: str = "sqlite:///tokenloom.db"
    retry_s: float = ranged(300.0, 0.0, 86400.0)
    retention_days: float = ranged(0.0, 0.0, 36500.0)  # finished jobs, files and streams older go; 0 = keep all


@dataclass(frozen=True, slots=True)
class TokenloomConfig(EngineConfig):
    """The whole configuration: the engine's sections plus the service's."""

    server: ServerConfig = field(default_factory=ServerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)


# Section name -> dataclass; derived from the annotations so they cannot drift.
SECTIONS: dict[str, type] = TokenloomConfig.sections()


def _check_keys(section: str, keys: Mapping[str, Any]) -> None:
    check_section_keys(SECTIONS, section, keys)


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
            raise ConfigError(
                f"config: top-level key {section} must be inside a [section]; known sections: {', '.join(SECTIONS)}"
            )
        _check_keys(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config: [{section}] must be a table, not {show(table)}", section)
        _check_keys(section, table)
        values[section].update(table)
    return values


def _apply_env(values: dict[str, dict[str, Any]], origin: dict[str, str], env: Mapping[str, str]) -> None:
    """Overlay TOKENLOOM_<SECTION>_<KEY> env vars onto `values`, parsed by the key's type."""
    for var, text in env.items():
        if var not in ENV_VARS:
            continue
        section, key = ENV_VARS[var]
        kind, bounds = field_specs(SECTIONS[section])[key]
        try:
            values[section][key] = parse_text_value(kind, text)
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


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> TokenloomConfig:
    """Read `path` (None = all defaults), overlay env overrides (None = os.environ), validate."""
    env = os.environ if env is None else env
    raw = {} if path is None else _read_toml(path)
    # Only read when the file gave values, so never with path None (raw is then empty).
    where = "" if path is None else os.fspath(path)
    try:
        values = _file_values(raw)
    except ConfigError as err:
        raise ConfigError(f"{err} (in {where})", err.key) from None
    # Remember where each non-default value came from, to point at it in errors.
    origin = {f"{s}.{k}": f"in {where}" for s, table in values.items() for k in table}
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
