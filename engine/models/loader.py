"""Load a Hugging Face checkpoint (config + safetensors) into `DecoderModel`.

Weights are renamed and fused as they are read (q|k|v and gate|up), and the model is built on
the meta device first so no memory is spent on a random initialisation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from tokenloom.engine.config import QuantizationConfig
from tokenloom.engine.config.cache_dir import default_cache_dir
from tokenloom.engine.cpu import can_pack, pack_linears
from tokenloom.engine.models.architectures import decoder_shape
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.models.family_weights import family_state_dict
from tokenloom.engine.models.gguf_checkpoint import GgufError, converted_checkpoint, gguf_file_in
from tokenloom.engine.models.moe import expert_state_dict
from tokenloom.engine.models.position_tables import attach_position_tables
from tokenloom.engine.models.prequantized import prequantized_problem
from tokenloom.engine.models.quantize import BITSANDBYTES_METHODS, QuantizationReport, quantize_model
from tokenloom.engine.models.transplant import load_through_transformers


class ModelLoadError(RuntimeError):
    pass


def resolve_checkpoint(name: str, cache_dir: Path | None = None) -> Path:
    """A local checkpoint directory as is; a GGUF file (or a directory holding one) converted once
    into `cache_dir` (engine/models/gguf_checkpoint.py); otherwise a hub id, downloaded when the hub
    is reachable."""
    path = Path(name).expanduser()
    try:
        gguf_file = gguf_file_in(path)
        if gguf_file is not None:
            return converted_checkpoint(gguf_file, cache_dir or default_cache_dir())
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from exc
    if path.is_dir():
        return path
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or path.suffix.lower() == ".gguf":
        raise ModelLoadError(
            f"model {name!r} is not a directory or .gguf file (and not a hub id like 'org/model'): set "
            "[model] name to a checkpoint directory holding config.json and *.safetensors, or a .gguf file"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.jinja"]))
    except Exception as exc:  # offline, unknown id, gated repo...
        raise ModelLoadError(
            f"model {name!r} is not a local directory and could not be fetched from the hub ({exc}); "
            "set [model] name to a checkpoint directory holding config.json and *.safetensors, or a .gguf file"
        ) from exc


def load_hf_config(path: Path) -> PretrainedConfig:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: point [model] name at a Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(path)


def load_model(
    path: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: QuantizationConfig | None = None,
) -> tuple[DecoderModel, QuantizationReport | None]:
    """The model, and what quantization did to it (None when it runs in full precision)."""
    if quantization is not None and quantization.enabled and quantization.method not in BITSANDBYTES_METHODS:
        return _load_prequantized(path, config, dtype, device, quantization.method)  # AWQ / GPTQ
    shape = decoder_shape(config)
    tensors = _read_safetensors(path)
    prefix = "model.layers.0."
    with torch.device("meta"):
        model = DecoderModel(
            shape,
            qkv_bias=any(prefix + f"self_attn.{p}_proj.bias" in tensors for p in ("q", "qkv")),
            o_bias=prefix + "self_attn.o_proj.bias" in tensors,
            mlp_bias=any(prefix + f"mlp.{p}_proj.bias" in tensors for p in ("gate", "gate_up")),
            qk_norm=prefix + "self_attn.q_norm.weight" in tensors,
        )
    state = _fused_state_dict(tensors, shape.num_layers, shape.tie_word_embeddings)
    if shape.moe is not None:
        state.update(expert_state_dict(tensors, shape.moe))
    state = family_state_dict(state, shape.features)  # Gemma's norm names and (1 + weight)
    state = _on_device(state, device, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint {path} does not match {shape.architecture}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if state["lm_head.weight"] is state["embed_tokens.weight"]:
        # load_state_dict wraps each entry in its own Parameter; one Parameter for both keeps the tie
        # visible to model.parameters() (weight_bytes counts the table once) and to anything that
        # replaces or moves one of them later.
        model.lm_head.weight = model.embed_tokens.weight
    attach_position_tables(model, config, dtype, device)
    report = None
    if quantization is not None and quantization.enabled:
        report = quantize_model(model, quantization, dtype, device)
    if can_pack(device, dtype):
        pack_linears(model)  # what stayed full precision (LM head, refused layers)
    return model.eval(), report


def _load_prequantized(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, device: torch.device, method: str
) -> tuple[DecoderModel, QuantizationReport]:
    problem = prequantized_problem(config, method)
    if problem is not None:
        raise ModelLoadError(problem)
    model = load_through_transformers(path, config, dtype, device)
    attach_position_tables(model, config, dtype, device)
    engine_package = __name__.rsplit(".", 2)[0]  # tokenloom.engine
    layers = sum(1 for m in model.modules() if not type(m).__module__.startswith(("torch.", engine_package + ".")))
    return model.eval(), QuantizationReport(method, quantized_layers=layers)


def _on_device(state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` converted to `dtype` on `device`, each distinct tensor once: entries that are the same
    tensor (a tied LM head and embedding table) stay one tensor there, not one copy per name."""
    converted: dict[int, torch.Tensor] = {}  # id(source tensor) -> its copy; `state` keeps the sources alive
    for tensor in state.values():
        if id(tensor) not in converted:
            converted[id(tensor)] = tensor.to(device=device, dtype=dtype)
    return {name: converted[id(tensor)] for name, tensor in state.items()}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights (pytorch_model.bin is not supported)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(path / file))
    return tensors


def _all_present(parts: list[torch.Tensor | None], names: str) -> list[torch.Tensor]:
    """`parts` when none is missing; a TypeError (as torch.cat gives for a None) naming them otherwise."""
    present = [part for part in parts if part is not None]
    if len(present) != len(parts):
        raise TypeError(f"checkpoint has only some of {names}")
    return present


def _fused_state_dict(tensors: dict[str, torch.Tensor], num_layers: int, tied: bool) -> dict[str, torch.Tensor]:
    state = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    lm_head = tensors.get("lm_head.weight")
    state["lm_head.weight"] = lm_head if lm_head is not None and not tied else state["embed_tokens.weight"]
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [tensors.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if qkv[0] is not None:
                qkv_parts = _all_present(qkv, f"{src}self_attn.q|k|v_proj.{kind}")
                state[f"{dst}self_attn.qkv_proj.{kind}"] = torch.cat(qkv_parts, dim=0)
            gate_up = [tensors.get(f"{src}mlp.{p}_proj.{kind}") for p in ("gate", "up")]
            if gate_up[0] is not None:
                gate_up_parts = _all_present(gate_up, f"{src}mlp.gate|up_proj.{kind}")
                state[f"{dst}mlp.gate_up_proj.{kind}"] = torch.cat(gate_up_parts, dim=0)
        for name in (
            "self_attn.qkv_proj.weight",  # Phi-3 stores q|k|v and gate|up fused already
            "self_attn.qkv_proj.bias",
            "mlp.gate_up_proj.weight",
            "mlp.gate_up_proj.bias",
            "self_attn.o_proj.weight",
            "self_attn.o_proj.bias",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.down_proj.weight",
            "mlp.down_proj.bias",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",  # Gemma; family_state_dict renames its norms
            "post_feedforward_layernorm.weight",
        ):
            if src + name in tensors:
                state[dst + name] = tensors[src + name]
    return state
