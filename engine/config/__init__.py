"""The engine's configuration: validated, frozen sections of config.toml, and where builds are cached.

`sections.py` holds the section dataclasses and `EngineConfig`; `fields.py` the field bounds and
checks behind them; `cache_dir.py` the one on-disk place for what is built once per machine. This
module is their surface, and stays free of torch: the settings import it to read config.toml.
"""

from tokenloom.engine.config.fields import ConfigError
from tokenloom.engine.config.sections import (
    ENGINE_SECTIONS,
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

__all__ = [
    "ENGINE_SECTIONS",
    "ConfigError",
    "ConfigSection",
    "EngineConfig",
    "KVCacheConfig",
    "MetricsConfig",
    "ModelConfig",
    "QuantizationConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "check_section_keys",
]
