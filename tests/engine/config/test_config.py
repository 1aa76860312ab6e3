"""Tests for engine/config/sections.py: defaults, the repo config.toml, env overrides, and error messages."""

import dataclasses
import tomllib
from pathlib import Path

import pytest

from tokenloom.settings.config import (
    ConfigError,
    KVCacheConfig,
    ModelConfig,
    SamplingDefaults,
    TokenloomConfig,
    load_config,
)
from tokenloom.settings.text_values import parse_text_value

REPO_CONFIG = Path(__file__).resolve().parents[3] / "config.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str = "", env: dict | None = None) -> str:
    path = write(tmp_path, text) if text else None
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return str(info.value)


# --- defaults and the shipped file -------------------------------------------------------


def test_defaults_load():
    cfg = load_config(None, env={})
    assert cfg == TokenloomConfig()
    assert cfg.server.port == 8000
    assert cfg.model.dtype == "auto" and cfg.model.max_model_len == 0
    assert cfg.model.seed == 0
    assert cfg.kv_cache.block_size == 16 and cfg.kv_cache.enabled is True
    assert cfg.kv_cache.gpu_memory_utilization == 0.85
    assert cfg.quantization.method == "int8" and cfg.quantization.int4_type == "nf4"
    assert isinstance(cfg.sampling, SamplingDefaults) and cfg.sampling.top_p == 0.9
    assert cfg.scheduler.max_num_batched_tokens == 0  # auto: sized for the device at engine start
    assert cfg.metrics.enable_ttft is True
    assert cfg.queue.max_attempts == 3
    assert cfg.database.url == "sqlite:///tokenloom.db"


def test_config_is_frozen():
    cfg = load_config(None, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_cache.block_size = 32  # type: ignore[misc]


def test_repo_config_toml_loads_and_matches_defaults():
    assert load_config(REPO_CONFIG, env={}) == TokenloomConfig()


def test_repo_config_toml_lists_every_key():
    raw = tomllib.loads(REPO_CONFIG.read_text())
    cfg = TokenloomConfig()
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        assert section.name in raw, f"config.toml lacks [{section.name}]"
        for key in dataclasses.fields(sub):
            assert key.name in raw[section.name], f"config.toml lacks {section.name}.{key.name}"


def test_file_values_override_defaults_and_ints_widen_to_float(tmp_path):
    path = write(tmp_path, "[kv_cache]\nblock_size = 32\nswap_space_gb = 8\n[model]\nname = 'x'\n")
    cfg = load_config(path, env={})
    assert cfg.kv_cache.block_size == 32
    assert cfg.kv_cache.swap_space_gb == 8.0 and isinstance(cfg.kv_cache.swap_space_gb, float)
    assert cfg.model.name == "x" and cfg.model.dtype == "auto"


# --- env overrides ------------------------------------------------------------------------


def test_env_overrides_int_float_bool_str(tmp_path):
    path = write(tmp_path, "[model]\nmax_model_len = 2048\n")
    env = {
        "TOKENLOOM_MODEL_MAX_MODEL_LEN": "1024",
        "TOKENLOOM_KV_CACHE_GPU_MEMORY_UTILIZATION": "0.5",
        "TOKENLOOM_KV_CACHE_ENABLE_PREFIX_CACHING": "false",
        "TOKENLOOM_DATABASE_URL": "postgresql://db/tokenloom",
        "TOKENLOOM_KV_CACHE_BLOCK_SIZE": "32",
    }
    cfg = load_config(path, env=env)
    assert cfg.model.max_model_len == 1024  # env beats the file
    assert cfg.kv_cache.gpu_memory_utilization == 0.5
    assert cfg.kv_cache.enable_prefix_caching is False
    assert cfg.database.url == "postgresql://db/tokenloom"
    assert cfg.kv_cache.block_size == 32


@pytest.mark.parametrize(
    "text, expected",
    [
        ("true", True),
        ("false", False),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("no", False),
        ("TRUE", True),
        (" No ", False),
    ],
)
def test_env_bool_parsing(text, expected):
    cfg = load_config(None, env={"TOKENLOOM_METRICS_ENABLE_TTFT": text})
    assert cfg.metrics.enable_ttft is expected


def test_env_list_parsing_is_comma_separated():
    assert parse_text_value("strs", "a, b,,c ") == ("a", "b", "c")


def test_reserved_env_vars_are_ignored():
    env = {"TOKENLOOM_CONFIG": "/etc/tokenloom.toml", "TOKENLOOM_API_KEY": "secret", "PATH": "/bin"}
    assert load_config(None, env=env) == TokenloomConfig()


def test_configured_api_key_env_var_is_ignored():
    env = {"TOKENLOOM_SERVER_API_KEY_ENV": "TOKENLOOM_ADMIN_KEY", "TOKENLOOM_ADMIN_KEY": "secret"}
    assert load_config(None, env=env).server.api_key_env == "TOKENLOOM_ADMIN_KEY"


def test_env_none_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_SCHEDULER_MAX_NUM_SEQS", "7")
    assert load_config().scheduler.max_num_seqs == 7


# --- errors name the key and what is allowed ---------------------------------------------


def test_unknown_section(tmp_path):
    msg = error_of(tmp_path, "[modle]\nname = 'x'\n")
    assert "unknown section [modle]" in msg and "model" in msg and "kv_cache" in msg


def test_unknown_key(tmp_path):
    msg = error_of(tmp_path, "[model]\nnmae = 'x'\n")
    assert msg.startswith("config: unknown key [model] nmae; known keys: name, served_name, tokenizer,")


def test_top_level_key_outside_a_section(tmp_path):
    msg = error_of(tmp_path, "port = 8000\n")
    assert "top-level key port must be inside a [section]" in msg and str(tmp_path) in msg


def test_section_must_be_a_table(tmp_path):
    assert "[model] must be a table" in error_of(tmp_path, "model = 'x'\n")


@pytest.mark.parametrize(
    "text, key, allowed",
    [
        ("[kv_cache]\nblock_size = '16'\n", "kv_cache.block_size", "an integer in [1, 256]"),
        ("[kv_cache]\nblock_size = 16.0\n", "kv_cache.block_size", "an integer in [1, 256]"),
        ("[server]\nport = true\n", "server.port", "an integer in [1, 65535]"),
        ("[kv_cache]\nenable_prefix_caching = 1\n", "kv_cache.enable_prefix_caching", "true or false"),
        ("[model]\nname = 3\n", "model.name", "a string"),
        ("[sampling]\ntop_p = 'high'\n", "sampling.top_p", "a number in (0, 1]"),
    ],
)
def test_wrong_type(tmp_path, text, key, allowed):
    msg = error_of(tmp_path, text)
    assert key in msg and "wrong type" in msg and allowed in msg


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "[kv_cache]\nblock_size = 0\n",
            "config: kv_cache.block_size = 0 is out of range: must be an integer in [1, 256]",
        ),
        (
            "[kv_cache]\ngpu_memory_utilization = 0\n",
            "kv_cache.gpu_memory_utilization = 0.0 is out of range: must be a number in (0, 1]",
        ),
        ("[kv_cache]\ngpu_memory_utilization = 1.5\n", "must be a number in (0, 1]"),
        ("[sampling]\npresence_penalty = -2.5\n", "sampling.presence_penalty = -2.5 is out of range"),
        ("[sampling]\ntemperature = nan\n", "sampling.temperature = nan is out of range"),
        ("[server]\nport = 70000\n", "server.port = 70000 is out of range: must be an integer in [1, 65535]"),
    ],
)
def test_out_of_range(tmp_path, text, expected):
    msg = error_of(tmp_path, text)
    assert expected in msg
    assert str(tmp_path) in msg  # says which file the bad value came from


def test_bad_choice(tmp_path):
    msg = error_of(tmp_path, "[model]\ndtype = 'float8'\n")
    assert 'config: model.dtype = "float8" is not one of: auto, float32, float16, bfloat16, float64' in msg


def test_bad_env_value_names_var_key_and_range():
    msg = error_of(None, env={"TOKENLOOM_KV_CACHE_BLOCK_SIZE": "big"})
    assert "TOKENLOOM_KV_CACHE_BLOCK_SIZE" in msg and "kv_cache.block_size" in msg
    assert "an integer in [1, 256]" in msg


def test_env_value_out_of_range_names_var():
    msg = error_of(None, env={"TOKENLOOM_KV_CACHE_BLOCK_SIZE": "0"})
    assert "kv_cache.block_size = 0 is out of range: must be an integer in [1, 256]" in msg
    assert "TOKENLOOM_KV_CACHE_BLOCK_SIZE" in msg


def test_bad_env_bool_lists_accepted_words():
    msg = error_of(None, env={"TOKENLOOM_METRICS_ENABLE_TPOT": "maybe"})
    assert "metrics.enable_tpot" in msg and "true/false/1/0/yes/no" in msg


def test_bad_env_choice():
    msg = error_of(None, env={"TOKENLOOM_MODEL_DEVICE": "tpu"})
    assert 'model.device = "tpu" is not one of: auto, cpu, cuda' in msg


def test_unknown_env_var_is_rejected():
    msg = error_of(None, env={"TOKENLOOM_MODEL_MAX_MODLE_LEN": "1024"})
    assert "TOKENLOOM_MODEL_MAX_MODLE_LEN" in msg
    assert "did you mean TOKENLOOM_MODEL_MAX_MODEL_LEN" in msg


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml") as info:
        load_config(missing, env={})
    assert str(missing) in str(info.value)


def test_invalid_toml_names_path(tmp_path):
    msg = error_of(tmp_path, "[model\n")
    assert str(tmp_path / "config.toml") in msg and "not valid TOML" in msg


def test_kv_cache_disabled_is_rejected_with_reason(tmp_path):
    msg = error_of(tmp_path, "[kv_cache]\nenabled = false\n")
    assert "kv_cache.enabled" in msg and "paged KV cache" in msg
    assert "quadratic" in msg and "remove the key or set it to true" in msg


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# --- replace and direct construction -----------------------------------------------------


def test_replace_changes_one_section():
    cfg = TokenloomConfig()
    new = cfg.replace("kv_cache", block_size=64, swap_space_gb=1)
    assert new.kv_cache.block_size == 64 and new.kv_cache.swap_space_gb == 1.0
    assert cfg.kv_cache.block_size == 16  # original untouched
    assert new.model is cfg.model


@pytest.mark.parametrize(
    "section, changes, needle",
    [
        ("kv_cache", {"block_size": 1000}, "kv_cache.block_size = 1000 is out of range"),
        ("kv_cache", {"enabled": False}, "paged KV cache"),
        ("model", {"dtype": "int3"}, "model.dtype"),
        ("model", {"nmae": "x"}, "unknown key [model] nmae"),
        ("modle", {"name": "x"}, "unknown section [modle]"),
    ],
)
def test_replace_revalidates(section, changes, needle):
    with pytest.raises(ConfigError) as info:
        TokenloomConfig().replace(section, **changes)
    assert needle in str(info.value)


def test_sections_validate_when_built_directly():
    with pytest.raises(ConfigError, match=r"model\.max_model_len"):
        ModelConfig(max_model_len=-1)
    assert KVCacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1.0
