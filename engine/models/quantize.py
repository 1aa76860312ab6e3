"""Weight quantization at load time through bitsandbytes: int8 (LLM.int8) and int4 (NF4 / FP4).

Every linear layer of the decoder blocks (fused qkv, o, fused gate_up, down) is replaced by a
bitsandbytes layer holding quantized weights; activations stay in the model dtype. Embeddings and
the LM head keep the model dtype unless `quantize_lm_head` asks otherwise: they are a small share
of a large model's weights and the most sensitive to error.

bitsandbytes' CPU kernels do not take every shape (its NF4 CPU path has asserted on layers as
narrow as stories260K's), so each quantized layer runs one probe forward at load; a layer whose
probe raises keeps full precision, and the start-up report names it. A model is never refused
because one odd layer could not be quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenloom.engine.config import QuantizationConfig

log = logging.getLogger("tokenloom.engine")

BITSANDBYTES_METHODS = ("int8", "int4")
_PROBE_ROWS = 3


@dataclass(slots=True)
class QuantizationReport:
    method: str  # "int8", "int4-nf4", "int4-fp4"
    quantized_layers: int = 0
    kept: dict[str, str] = field(default_factory=dict)  # layer name -> why it stayed full precision
    bytes_before: int = 0  # every weight of the model in its full-precision dtype

    def summary(self) -> str:
        text = f"quantization: {self.method} (bitsandbytes) on {self.quantized_layers} linear layers"
        if self.kept:
            names = ", ".join(list(self.kept)[:4]) + (" ..." if len(self.kept) > 4 else "")
            reason = next(iter(self.kept.values()))
            text += f"; {len(self.kept)} kept in full precision ({names}): {reason}"
        return text


def quantize_model(
    model: nn.Module, config: QuantizationConfig, dtype: torch.dtype, device: torch.device
) -> QuantizationReport:
    """Replace the decoder's linear layers with bitsandbytes ones, in place."""
    try:
        import bitsandbytes as bnb  # imported here: loading it costs a second and it logs at import
    except ImportError as exc:
        raise ImportError(
            "[quantization] method int8/int4 needs the bitsandbytes package: pip install bitsandbytes"
        ) from exc
    # bitsandbytes logs "inputs will be cast to float16" on EVERY int8 matmul of a float32 model;
    # that cast is part of LLM.int8 and covered by the accuracy tests, so say it once, not per step.
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    label = "int8" if config.method == "int8" else f"int4-{config.int4_type}"
    report = QuantizationReport(label, bytes_before=sum(p.numel() * p.element_size() for p in model.parameters()))
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and (config.quantize_lm_head or not name.endswith("lm_head"))
    ]
    for name, linear in targets:
        try:
            quantized = _bnb_linear(bnb, linear, config, dtype, device)
            _probe(quantized, linear.in_features, dtype, device)
        except Exception as exc:  # an unsupported shape on this backend: keep this layer as it is
            report.kept[name] = f"bitsandbytes refused this shape on {device.type} ({str(exc).strip()[:120]})"
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
        report.quantized_layers += 1
    if report.kept:
        log.warning("%s", report.summary())
    return report


def _bnb_linear(
    bnb, linear: nn.Linear, config: QuantizationConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    weight = linear.weight.detach().to("cpu")  # quantized as it moves to the device below
    bias = linear.bias is not None
    if config.method == "int8":
        # threshold 0: no outlier columns kept in fp16 (that path is CUDA-only and slower); the
        # int8 oracle test bounds the error this costs.
        layer = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False, threshold=0.0
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=bias,
            compute_dtype=dtype,
            quant_type=config.int4_type,
            quant_storage=torch.uint8,
        )
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=config.int4_type)
    if bias:
        layer.bias = nn.Parameter(linear.bias.detach().to("cpu", dtype), requires_grad=False)
    return layer.to(device)


def _probe(layer: nn.Module, in_features: int, dtype: torch.dtype, device: torch.device) -> None:
    layer.eval()  # bitsandbytes repacks 4-bit weights for its CPU kernel on the first eval forward
    with torch.inference_mode():
        out = layer(torch.zeros(_PROBE_ROWS, in_features, dtype=dtype, device=device))
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite output")


def quantization_state_bytes(module: nn.Module) -> int:
    """Bytes of bitsandbytes' scales, which live beside the quantized weight tensors."""
    total = 0
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if weight is None or not type(layer).__module__.startswith("bitsandbytes"):
            continue
        for scales in (
            getattr(weight, "SCB", None),  # int8: one scale per output row
            getattr(getattr(weight, "quant_state", None), "absmax", None),
        ):  # int4: per block
            if isinstance(scales, torch.Tensor):
                total += scales.numel() * scales.element_size()
    return total
