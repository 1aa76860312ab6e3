"""Shared fixtures: small random-initialised checkpoints of each supported family, built once."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run in triton's CPU interpreter here; it must be chosen before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tokenloom.engine.models.demo.random_checkpoint import build_random_checkpoint
from tokenloom.settings.config import load_config

STORIES_260K = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"

# Small shapes that still exercise GQA, biases, q/k norms, explicit head_dim and sliding windows.
FAMILIES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    "mistral": dict(architecture="MistralForCausalLM", sliding_window=24),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", head_dim=32),
}
ORACLE_CONFIG = dict(max_position_embeddings=256, initializer_range=0.1)


TESTS_ROOT = Path(__file__).resolve().parent
# Test tiers whose files use real Postgres, Redis, worker or API processes; a pure-logic module
# living beside them sets NEEDS_SERVICES = False at module level to stay in the fast tier.
SERVICE_TIERS = frozenset({"api", "worker", "store", "reliability", "compose"})
DOCKER_TIERS = frozenset({"compose"})


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (pyproject.toml registers the markers; CONTRIBUTING.md lists
    the commands): `services` by folder, `docker` for tests/compose; `slow` is set by the modules
    themselves (`pytestmark`)."""
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS_ROOT).parts
        tier = parts[0] if len(parts) > 1 else ""
        if tier in SERVICE_TIERS and getattr(item.module, "NEEDS_SERVICES", True):
            item.add_marker(pytest.mark.services)
        if tier in DOCKER_TIERS:
            item.add_marker(pytest.mark.docker)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Build the C++ CPU kernels once, before any test starts a worker or API subprocess: a cold
    build (~20 s on 2 cores) inside a subprocess would count against that test's start-up wait.
    A build failure is left to tests/engine/cpu/test_cpu_kernels.py to report."""
    from tokenloom.engine.cpu.kernels import CpuKernelsUnavailable, load_cpu_kernels

    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable:
        pass


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: build_random_checkpoint(root / name, seed=i, **ORACLE_CONFIG, **spec)
        for i, (name, spec) in enumerate(FAMILIES.items())
    }


@pytest.fixture(scope="session")
def llama_checkpoint(family_checkpoints) -> Path:
    return family_checkpoints["llama"]


def tiny_llama_checkpoint(path: Path, tie_word_embeddings: bool) -> Path:
    """A seeded random 2-layer Llama saved by transformers itself (no tokenizer: loader tests only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def engine_config(checkpoint: Path, **sections):
    """Defaults plus `[model] name = checkpoint`; `sections` maps a section to its changes."""
    config = load_config(None, env={}).replace("model", name=str(checkpoint), dtype="float32")
    for section, changes in sections.items():
        config = config.replace(section, **changes)
    return config


@pytest.fixture
def stories260k() -> Path:
    if not (STORIES_260K / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES_260K} (it ships in the project's shared/ folder)")
    return STORIES_260K
