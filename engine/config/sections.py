"""The engine's configuration sections: the parts of config.toml that shape the model and its batching.

Frozen, validated dataclasses. Bounds are declared on the fields (`ranged`, `one_of`) and checked
in each section's __post_init__, so a section built by hand or via `EngineConfig.replace` is
validated exactly like one read from a file. The engine reads nothing else: the service's sections
([server], [queue], [database]) and reading the file and the environment live in
tokenloom.settings, whose TokenloomConfig extends EngineConfig.
"""

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenloom.engine.config.fields import ConfigError, check_section, field_specs, one_of, ranged

__all__ = [
    "ConfigError",
    "EngineConfig",
    "KVCacheConfig",
    "MetricsConfig",
    "ModelConfig",
    "QuantizationConfig",
    "SamplingDefaults",
    "SchedulerConfig",
    "check_section_keys",
]


class ConfigSection:
    """Base of the section dataclasses: validate all fields on construction."""

    __slots__ = ()
    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        check_section(self, self.SECTION)
        self._cross_check()

    def _cross_check(self) -> None:
        """Checks spanning several fields; override per section."""


@dataclass(frozen=True, slots=True)
class ModelConfig(ConfigSection):
    SECTION: ClassVar[str] = "model"
    name: str = ""  # HF checkpoint dir, .gguf file or hub id; "" = built-in demo model
    served_name: str = ""  # another name clients may use in "model" (like vLLM's --served-model-name)
    tokenizer: str = ""  # "" = same as name
    max_model_len: int = ranged(0, 0, 1_048_576)  # 0 = the model's own limit
    dtype: str = one_of("auto", "auto", "float32", "float16", "bfloat16", "float64")
    device: str = one_of("auto", "auto", "cpu", "cuda")
    attention_backend: str = one_of("auto", "auto", "torch", "triton", "cpu")
    chat_template: str = ""  # Jinja template path; "" = the tokenizer's own
    seed: int = ranged(0, 0, 2**63 - 1)
    enforce_eager: bool = False  # true: no CUDA graphs, every step launches its kernels one by one (CUDA only)
    demo: str = one_of(
        "smollm2", "smollm2", "random"
    )  # demo model when name is "": SmolLM2-135M-Instruct via pip (random offline), or random weights


@dataclass(frozen=True, slots=True)
class KVCacheConfig(ConfigSection):
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
class QuantizationConfig(ConfigSection):
    SECTION: ClassVar[str] = "quantization"
    enabled: bool = False
    method: str = one_of("int8", "int8", "int4", "awq", "gptq")
    int4_type: str = one_of("nf4", "nf4", "fp4")
    calibration_samples: int = ranged(128, 1, 100_000)
    quantize_lm_head: bool = False


@dataclass(frozen=True, slots=True)
class SamplingDefaults(ConfigSection):
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


# What `0 = auto` resolves to per device type: (max_num_seqs, max_num_batched_tokens). A GPU step
# costs about the same at 8 as at 256 sequences (decode reads the weights once either way), so
# CUDA batches wide; a CPU step's cost grows with its tokens, so the CPU keeps steps small.
AUTO_SCHEDULER_LIMITS: dict[str, tuple[int, int]] = {"cpu": (64, 512), "cuda": (256, 8192)}


@dataclass(frozen=True, slots=True)
class SchedulerConfig(ConfigSection):
    SECTION: ClassVar[str] = "scheduler"
    max_num_seqs: int = ranged(0, 0, 4096)  # max sequences running in one batch; 0 = auto: 64 on a CPU, 256 on CUDA
    max_num_batched_tokens: int = ranged(
        0, 0, 1_048_576
    )  # max tokens processed in one engine step; 0 = auto: 512 on a CPU, 8192 on CUDA
    # A steady stream of chat must never stop a batch (engine/core/seat_share.py).
    min_seat_share: float = ranged(
        0.1, 0, 0.5
    )  # seats owed to each class of work with requests, as a share of max_num_seqs (at least 1); 0 = strict priority

    def resolved_for(self, device_type: str) -> "SchedulerConfig":
        """A copy with every auto (0) limit replaced by the device's default; set values are kept."""
        seqs, tokens = AUTO_SCHEDULER_LIMITS.get(device_type, AUTO_SCHEDULER_LIMITS["cpu"])
        return dataclasses.replace(
            self,
            max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
        )


@dataclass(frozen=True, slots=True)
class MetricsConfig(ConfigSection):
    SECTION: ClassVar[str] = "metrics"
    enable_ttft: bool = True  # record each request's time to first token (results, database, run summary)
    enable_tpot: bool = True  # record per-token times: TPOT and inter-token latencies
    enable_throughput: bool = True  # tokens per second in the run summary and progress bar


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine is configured by; one attribute per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        for name, cls in self.sections().items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"config: [{name}] must be a {cls.__name__}", name)

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Section name -> dataclass, in declaration order (subclasses add theirs after these)."""
        return typing.get_type_hints(cls)

    def replace(self, section: str, **changes: Any):
        """Copy with some of one section's keys changed; the new values are validated."""
        check_section_keys(self.sections(), section, changes)
        new_section = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **{section: new_section})


def check_section_keys(sections: Mapping[str, type], section: str, keys: Mapping[str, Any]) -> None:
    """Reject an unknown section or key with a message listing what is known."""
    if section not in sections:
        raise ConfigError(f"config: unknown section [{section}]; known sections: {', '.join(sections)}")
    known = field_specs(sections[section])
    for key in keys:
        if key not in known:
            raise ConfigError(
                f"config: unknown key [{section}] {key}; known keys: {', '.join(known)}",
                f"{section}.{key}",
            )


# The engine's sections, in file order.
ENGINE_SECTIONS: dict[str, type] = EngineConfig.sections()
