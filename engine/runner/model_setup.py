"""From `[model]` config to a loaded model, tokenizer and limits, plus the start-up report."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloom.engine.config import ModelConfig, QuantizationConfig
from tokenloom.engine.config.cache_dir import default_cache_dir
from tokenloom.engine.cpu import PackedLinear
from tokenloom.engine.inputs.tokenization import PromptEncoder
from tokenloom.engine.models.architectures import DecoderShape
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.models.demo.choice import DemoModel, demo_model
from tokenloom.engine.models.loader import ModelLoadError, load_hf_config, load_model, resolve_checkpoint
from tokenloom.engine.models.moe import moe_report_line
from tokenloom.engine.models.quantize import QuantizationReport, quantization_state_bytes
from tokenloom.engine.runner.device import resolve_device, resolve_dtype
from tokenloom.engine.runner.kv_plan import GIB, KVPoolPlan


@dataclass(slots=True)
class LoadedModel:
    name: str  # what requests call the model: [model] name, or "tokenloom-demo"
    checkpoint: Path
    demo: DemoModel | None  # the built-in demo model, when no [model] name is configured
    model: DecoderModel
    encoder: PromptEncoder
    shape: DecoderShape
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    quantization: QuantizationReport | None = None

    @property
    def is_demo(self) -> bool:
        return self.demo is not None

    @property
    def weight_bytes(self) -> int:
        return model_weight_bytes(self.model)


def model_weight_bytes(model: DecoderModel) -> int:
    """Bytes of every weight the model holds, a tied embedding table and LM head once."""
    packed = sum(m.weight_nbytes for m in model.modules() if isinstance(m, PackedLinear))
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # a shared Parameter once
    # AWQ/GPTQ modules keep their packed weights and scales in buffers, not parameters.
    foreign = sum(
        b.numel() * b.element_size()
        for m in model.modules()
        if not type(m).__module__.startswith(_OWN_MODULE_PREFIXES)
        for b in m.buffers(recurse=False)
    )
    return packed + params + foreign + quantization_state_bytes(model)


# Modules whose buffers are counted above already (parameters, packed weights, bitsandbytes state).
_OWN_MODULE_PREFIXES = ("torch.", "bitsandbytes.", "tokenloom.engine.")


def load_for_config(
    config: ModelConfig, cache_dir: Path | None = None, quantization: QuantizationConfig | None = None
) -> LoadedModel:
    device = resolve_device(config.device)  # first: a missing device is known before any checkpoint work
    cache_dir = cache_dir or default_cache_dir()
    demo = demo_model(cache_dir, config.demo) if not config.name else None
    checkpoint = demo.checkpoint if demo is not None else resolve_checkpoint(config.name, cache_dir)
    hf_config = load_hf_config(checkpoint)
    dtype = resolve_dtype(config.dtype, _checkpoint_dtype(hf_config), device)
    model, quant_report = load_model(checkpoint, hf_config, dtype, device, quantization)
    shape = model.shape
    max_model_len = config.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ModelLoadError(
            f"[model] max_model_len = {max_model_len} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings}): lower it, or set 0 to use the model's own limit"
        )
    tokenizer_path = resolve_checkpoint(config.tokenizer, cache_dir) if config.tokenizer else checkpoint
    encoder = PromptEncoder.load(tokenizer_path, config.chat_template)
    return LoadedModel(
        name=config.name or "tokenloom-demo",
        checkpoint=checkpoint,
        demo=demo,
        model=model,
        encoder=encoder,
        shape=shape,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(checkpoint, hf_config, encoder),
        quantization=quant_report,
    )


def startup_report(
    loaded: LoadedModel, plan: KVPoolPlan, backend_name: str, kv_dtype: torch.dtype | None = None
) -> str:
    shape = loaded.shape
    max_len_seqs = plan.num_token_slots // loaded.max_model_len
    lines = [
        f"model: {loaded.name} ({shape.architecture}, {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_heads} query / {shape.num_kv_heads} KV heads) from {loaded.checkpoint}",
        f"device {loaded.device}, dtype {str(loaded.dtype).removeprefix('torch.')}, attention backend {backend_name}"
        f"{f', {torch.get_num_threads()} CPU threads' if loaded.device.type == 'cpu' else ''}",
        _weights_line(loaded),
        f"KV cache{_kv_dtype_note(loaded, kv_dtype)}: {plan.bytes_per_token:,} bytes per token, {plan.num_blocks:,} blocks of {plan.block_size} "
        f"tokens = {plan.num_token_slots:,} tokens ({plan.total_bytes / GIB:.3f} GiB); "
        f"max_model_len {loaded.max_model_len:,} -> {max_len_seqs:,} full-length sequences at once",
        f"swap space: {plan.num_swap_blocks:,} blocks ({plan.num_swap_blocks * plan.block_size * plan.bytes_per_token / GIB:.3f} GiB"
        " of host memory) for preempted sequences"
        if plan.num_swap_blocks
        else "swap space: none ([kv_cache] swap_space_gb = 0): preempted sequences are recomputed",
    ]
    if shape.moe is not None:
        lines.insert(1, moe_report_line(shape.moe, loaded.device, loaded.dtype, loaded.quantization is not None))
    lines[1:1] = _family_lines(loaded, backend_name)
    if loaded.demo is not None:
        lines.insert(0, _demo_note(loaded.demo))
    return "\n".join(lines)


def _demo_note(demo: DemoModel) -> str:
    note = f"NOTE: no [model] name configured, so the built-in demo model ({demo.description}) is used"
    if demo.is_random:
        return (
            note + ": its output is gibberish. Set [model] name to a Hugging Face checkpoint directory "
            "or .gguf file for real text."
        )
    return note + ". Set [model] name to a Hugging Face checkpoint directory or .gguf file for your own model."


def _family_lines(loaded: LoadedModel, backend_name: str) -> list[str]:
    """What the family does beyond the shared Llama block, and whether the CPU's fused layer loop
    takes it; nothing for Llama-shaped families."""
    shape = loaded.shape
    features = shape.features
    notes = features.describe(shape.head_dim)
    if not notes:
        return []
    if shape.hidden_act != "silu":
        notes.append(f"{shape.hidden_act} gated MLP")
    if getattr(loaded.model.layers[0].self_attn, "q_norm", None) is not None:  # AWQ/GPTQ layers may lack it
        notes.append("per-head q/k norms")
    windows = [w for w in shape.sliding_windows if w is not None]
    if windows:
        notes.insert(0, f"sliding window {windows[0]} on {len(windows)} of {shape.num_layers} layers")
    lines = [f"family {shape.architecture.removesuffix('ForCausalLM')}: " + ", ".join(notes)]
    differences = features.layer_loop_differences(shape.hidden_act)
    if backend_name.split(" ", 1)[0] == "cpu" and differences:
        lines.append(
            f"CPU decoder stack (all layers in one C++ call) not used: it has no {', '.join(differences)}; "
            "the layers run in the Python loop on the same C++ attention and norm kernels"
        )
    return lines


def _kv_dtype_note(loaded: LoadedModel, kv_dtype: torch.dtype | None) -> str:
    if kv_dtype is None or kv_dtype == loaded.dtype:
        return ""
    return f" (float32: CPU attention is faster in float32 than in {str(loaded.dtype).removeprefix('torch.')})"


PACKED_KERNEL_NAMES = {
    "mkl": "MKL's packed GEMM",
    "onednn": "oneDNN",
    "onednn+brgemm": "AMX brgemm (oneDNN's micro-kernel on oneDNN's packing)",
}


def _weights_line(loaded: LoadedModel) -> str:
    line = f"weights: {loaded.weight_bytes / 2**20:,.1f} MiB"
    kernels = Counter(m.kernel for m in loaded.model.modules() if isinstance(m, PackedLinear))
    if kernels:  # which GEMM a slow CPU run is using (docs/troubleshooting.md: "Slow on a CPU")
        line += "; linear layers packed at load: " + ", ".join(
            f"{count} for {PACKED_KERNEL_NAMES[kernel]}" for kernel, count in sorted(kernels.items())
        )
    report = loaded.quantization
    if report is not None and report.bytes_before:
        line += (
            f" after {report.method} quantization ({report.bytes_before / 2**20:,.1f} MiB before, "
            f"{loaded.weight_bytes / max(report.bytes_before, 1):.0%})\n{report.summary()}"
        )
    elif report is not None:
        line += f" ({report.method}, quantized ahead of time; {report.quantized_layers} quantized modules)"
    return line


def _checkpoint_dtype(hf_config) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _eos_token_ids(checkpoint: Path, hf_config, encoder: PromptEncoder) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what transformers' generate stops on), else config/tokenizer."""
    ids: list[int] = []
    generation_config = checkpoint / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    if not ids:
        value = getattr(hf_config, "eos_token_id", None)
        ids.extend(value if isinstance(value, list) else [value] if value is not None else [])
    if not ids and encoder.tokenizer.eos_token_id is not None:
        ids.append(encoder.tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
