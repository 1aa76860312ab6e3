"""Checkpoints quantized ahead of time (AWQ, GPTQ): what they need before they can load.

Their weights are packed integers plus scales that only the method's kernels can multiply
(autoawq for AWQ; gptqmodel for GPTQ). This module checks, at start-up, that the checkpoint really
is quantized with the configured method and that those kernels are installed, and explains what
to change otherwise; nothing is loaded half-way. When both hold, transformers' quantizer
integration loads the checkpoint and engine/models/transplant.py puts its quantized modules into
tokenloom's decoder.
"""

from __future__ import annotations

import importlib.util

from transformers import PretrainedConfig

KERNEL_PACKAGES = {  # method -> (import name, pip name)
    "awq": (("awq",), "autoawq"),
    "gptq": (("gptqmodel", "auto_gptq"), "gptqmodel"),
}


def prequantized_problem(config: PretrainedConfig, method: str) -> str | None:
    """Why a checkpoint cannot be loaded with [quantization] method = awq | gptq (a user-facing
    message), or None when it can."""
    declared = getattr(config, "quantization_config", None) or {}
    if not isinstance(declared, dict):
        declared = declared.to_dict()
    found = declared.get("quant_method")
    if found != method:
        what = f"is quantized with {found!r}" if found else "is not quantized (no quantization_config in config.json)"
        return (
            f"[quantization] method = {method!r} loads checkpoints already quantized with {method.upper()}, but this "
            f'checkpoint {what}. To quantize a full-precision checkpoint at load, set method = "int8" or "int4"; '
            f"or set [quantization] enabled = false."
        )
    imports, pip_name = KERNEL_PACKAGES[method]
    if not any(importlib.util.find_spec(name) for name in imports):
        return (
            f"this {method.upper()} checkpoint needs the {pip_name} package for its kernels: pip install {pip_name} "
            f'(CUDA); or use the full-precision checkpoint with [quantization] method = "int8" or "int4".'
        )
    return None
