"""Routed experts: the mixture-of-experts MLP of Qwen3-MoE and Mixtral.

A router scores every token against every expert; each token goes to its top-k experts, and the
layer's output is the routing-weighted sum of those experts' SwiGLU MLPs. The math follows
transformers 5.x's modeling code:
- Qwen3-MoE: softmax over all experts (float32), top-k, renormalised over the k when
  `norm_topk_prob`, cast back to the model dtype. Layers listed in `mlp_only_layers`, or whose
  number is not a multiple of `decoder_sparse_step`, keep a dense MLP.
- Mixtral: softmax over all experts (float32), top-k, always renormalised (the same as a softmax
  over the k logits), weights kept in float32, so the weighting and the sum over k run in float32.

Grouped compute: the (token, expert) pairs are sorted by expert, so each expert's rows are one
contiguous slice, and each expert's two projections run once over its slice. Where torch's grouped
GEMM (`torch.nn.functional.grouped_mm` / `torch._grouped_mm`, the op transformers' default experts
implementation calls) has its device-only kernel - CUDA, bfloat16, compute capability 9.x or 10.x -
one call covers every expert, reads the slice bounds from a device tensor and launches no
per-expert work, so a CUDA graph can capture it. Everywhere else a loop of one matmul per non-empty
slice does the same work after one host read of the bounds; torch's own grouped GEMM there is the
same loop in C++ behind the same host read (`offs.cpu()`), and on CPU it is slower than ours (see
`prefers_grouped_mm`). A host read cannot be captured, so such models run decode steps without
CUDA graphs (`moe_graph_blocker`). Either way no expert computes a token that was not routed to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "Qwen3-MoE", "MixtralForCausalLM": "Mixtral"}


@dataclass(frozen=True, slots=True)
class MoeShape:
    family: str  # "Qwen3-MoE", "Mixtral"
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool  # renormalise the k weights to sum to 1
    float32_weights: bool  # Mixtral keeps the routing weights (and the weighted sum) in float32
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP

    def describe(self) -> str:
        num_sparse = sum(self.sparse_layers)
        dense = len(self.sparse_layers) - num_sparse
        return (
            f"{self.family}: {self.num_experts} experts, top-{self.top_k}, "
            f"{'normalised' if self.normalize_top_k else 'not normalised'}, expert MLP width "
            f"{self.expert_intermediate_size}; {num_sparse} of {len(self.sparse_layers)} layers routed"
            f"{f' ({dense} dense)' if dense else ''}"
        )


def moe_shape(config: PretrainedConfig, architecture: str) -> MoeShape | None:
    """The routing of a mixture-of-experts checkpoint; None for a dense family."""
    family = MOE_ARCHITECTURES.get(architecture)
    if family is None:
        return None
    num_layers = config.num_hidden_layers
    if architecture == "MixtralForCausalLM":
        return MoeShape(
            family,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            normalize_top_k=True,
            float32_weights=True,
            sparse_layers=(True,) * num_layers,
        )
    num_experts = config.num_experts
    dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoeShape(
        family,
        num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        normalize_top_k=bool(config.norm_topk_prob),
        float32_weights=False,
        sparse_layers=sparse,
    )


class Routing(NamedTuple):
    expert_ids: torch.Tensor  # [num_tokens, top_k] int64
    weights: torch.Tensor  # [num_tokens, top_k] model dtype, or float32 (Mixtral)


class TopKRouter(nn.Module):
    """Scores tokens against experts. Its weight is a plain parameter, not an nn.Linear, so load-time
    quantization and CPU packing leave it alone: the expert choice is the most error-sensitive
    step of the layer, and a flipped choice changes the output, not just its last bits."""

    def __init__(self, hidden_size: int, shape: MoeShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.num_experts, hidden_size))
        self.top_k = shape.top_k
        self.normalize_top_k = shape.normalize_top_k
        self.float32_weights = shape.float32_weights

    def forward(self, hidden: torch.Tensor) -> Routing:  # hidden: [num_tokens, hidden_size]
        logits = F.linear(hidden, self.weight)  # [num_tokens, num_experts]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(expert_ids, weights if self.float32_weights else weights.to(logits.dtype))


class RoutedExperts(nn.Module):
    """The MoE MLP: a router plus `num_experts` SwiGLU MLPs stored as stacked weights (the layout of
    transformers' experts modules, gate rows before up rows)."""

    def __init__(self, hidden_size: int, shape: MoeShape, hidden_act: str):
        super().__init__()
        self.num_experts = shape.num_experts
        self.intermediate_size = shape.expert_intermediate_size
        self.router = TopKRouter(hidden_size, shape)
        self.gate_up_proj = nn.Parameter(
            torch.empty(shape.num_experts, 2 * shape.expert_intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(shape.num_experts, hidden_size, shape.expert_intermediate_size))
        self.act = ACT2FN[hidden_act]
        self.is_swiglu = hidden_act == "silu"

    def forward(self, hidden: torch.Tensor, ops) -> torch.Tensor:  # hidden: [num_tokens, hidden_size]
        routing = self.router(hidden)
        gate = ops.silu_and_mul if self.is_swiglu else self._gate
        return grouped_experts(hidden, routing, self.gate_up_proj, self.down_proj, gate, self.num_experts)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


def grouped_experts(
    hidden: torch.Tensor,
    routing: Routing,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate,
    num_experts: int,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """sum_k weight_k * expert_k(hidden) per token, each expert run once over the rows routed to it."""
    num_tokens, top_k = routing.expert_ids.shape
    flat_experts = routing.expert_ids.reshape(-1)  # [num_tokens * top_k]: pair p is token p // top_k
    sorted_experts, order = torch.sort(flat_experts)
    rows = hidden[order // top_k]  # [num_pairs, hidden_size], grouped by expert
    ends = expert_slice_ends(sorted_experts, num_experts)
    if use_grouped_mm is None:
        use_grouped_mm = prefers_grouped_mm(hidden.device, hidden.dtype)
    matmul = _grouped_mm if use_grouped_mm else _per_expert_mm
    out = matmul(gate(matmul(rows, gate_up_proj.transpose(1, 2), ends)), down_proj.transpose(1, 2), ends)
    weighted = out * routing.weights.reshape(-1)[order, None]  # float32 for Mixtral: promotes
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    # A sum over the k slots of each token, in slot order (deterministic, unlike index_add_ on CUDA).
    return unsorted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def expert_slice_ends(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """End of each expert's slice of the sorted (token, expert) pairs: [num_experts] int32, expert e's
    rows are [ends[e - 1], ends[e]).

    A binary search of each expert id in the sorted ids, on the device: exact integer work with a
    fixed output shape, so it neither reads the host nor allocates by data (a CUDA graph can capture
    it). bincount sizes its output from the data on the host; histc counts in floating point and on
    CUDA asks the allocator for free memory, which capture may forbid.
    """
    expert_ids = torch.arange(num_experts, device=sorted_experts.device, dtype=sorted_experts.dtype)
    return torch.searchsorted(sorted_experts, expert_ids, right=True, out_int32=True)


def _grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    # rows: [num_pairs, in]; weights: [num_experts, in, out] (a transposed view); ends: [num_experts] int32
    return _grouped_mm_op()(rows, weights, offs=ends)


def _per_expert_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The portable grouped GEMM: one matmul per non-empty contiguous slice (one host read of the ends)."""
    out = rows.new_empty(rows.shape[0], weights.shape[2])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(rows[start:end], weights[expert], out=out[start:end])
        start = end
    return out


def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs on this device and dtype: tried once on a small problem
    (an empty group included) and compared with the per-expert loop, since which devices, dtypes and
    alignments it takes has changed from one torch release to the next."""
    if _grouped_mm_op() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 32, generator=generator).to(device, dtype)
    weights = torch.randn(3, 48, 32, generator=generator).to(device, dtype).transpose(1, 2)
    ends = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)
    try:
        grouped = _grouped_mm(rows, weights, ends)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.allclose(grouped.float(), _per_expert_mm(rows, weights, ends).float(), rtol=2e-2, atol=2e-2))


# Compute capability majors on which torch's grouped GEMM has its CUTLASS kernel: Hopper (9.x) and
# datacenter Blackwell (10.x), for bfloat16 inputs and output only. Any other GPU or dtype takes
# torch's fallback, which copies the slice bounds to the host first.
SYNC_FREE_GROUPED_MM_MAJORS = frozenset({9, 10})


def grouped_mm_is_sync_free(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether torch's grouped GEMM runs on the device alone for `dtype` on a CUDA GPU of compute
    `capability` (None: no CUDA GPU)."""
    return capability is not None and capability[0] in SYNC_FREE_GROUPED_MM_MAJORS and dtype == torch.bfloat16


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The device's CUDA compute capability; None on a CPU, and on ROCm, where whether the grouped
    GEMM avoids the host depends on the GPU architecture and the build, not on a capability."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def prefers_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """grouped_mm only where it needs no host read; the per-expert loop elsewhere: off that kernel
    torch's grouped_mm is the same loop, and on a CPU torch's kernel took 3.3x the loop's time at
    decode row counts (64 rows, 8 experts of 512x1024, bfloat16) and the same at 1,024 rows."""
    return grouped_mm_is_sync_free(dtype, cuda_capability(device)) and grouped_mm_supported(device, dtype)


def experts_sync_reason(dtype: torch.dtype, capability: tuple[int, int] | None, uses_grouped_mm: bool) -> str | None:
    """Why the routed experts read their slice bounds on the host every forward, a read CUDA graph
    capture rejects; None where they do not (`uses_grouped_mm` on its device-only kernel)."""
    if uses_grouped_mm:
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    if capability is None:
        cause = "on ROCm"
    elif dtype != torch.bfloat16:
        cause = f"in {dtype_name}"
    elif capability[0] not in SYNC_FREE_GROUPED_MM_MAJORS:
        cause = f"on compute capability {capability[0]}.{capability[1]}"
    else:
        cause = f"here: torch {torch.__version__} has no working grouped GEMM for {dtype_name} on this GPU"
    return (
        f"the routed experts read their row counts on the host every step {cause} (torch's grouped GEMM "
        "avoids that only in bfloat16 on compute capability 9.x or 10.x), which graph capture forbids"
    )


def moe_graph_blocker(shape: MoeShape | None, device: torch.device, dtype: torch.dtype) -> str | None:
    """For the graph plan: why decode steps of this model cannot be captured on `device`; None
    for dense models, off CUDA (graphs are off there anyway) and where the experts never sync."""
    if shape is None or device.type != "cuda":
        return None
    return experts_sync_reason(dtype, cuda_capability(device), prefers_grouped_mm(device, dtype))


def expert_gemm_name(device: torch.device, dtype: torch.dtype) -> str:
    """For the start-up report: which grouped GEMM runs the experts here."""
    if prefers_grouped_mm(device, dtype):
        return "torch grouped_mm (one call for all experts)"
    return "one matmul per routed expert over its sorted rows"


def expert_state_dict(tensors: dict[str, torch.Tensor], shape: MoeShape) -> dict[str, torch.Tensor]:
    """The routed layers' weights under tokenloom's names: per-expert matrices stacked.

    Checkpoints store each expert's projections separately (Qwen3-MoE `mlp.experts.{e}.gate_proj`,
    Mixtral `block_sparse_moe.experts.{e}.w1` = gate, w3 = up, w2 = down); transformers 5.x
    in-memory layout (`mlp.experts.gate_up_proj`) is taken as is.
    """
    state = {}
    for i, sparse in enumerate(shape.sparse_layers):
        if not sparse:
            continue
        block = f"model.layers.{i}.{'block_sparse_moe' if shape.family == 'Mixtral' else 'mlp'}."
        if block + "gate.weight" not in tensors:
            block = f"model.layers.{i}.mlp."
        names = (
            ("w1", "w3", "w2") if block + "experts.0.w1.weight" in tensors else ("gate_proj", "up_proj", "down_proj")
        )
        dst = f"layers.{i}.mlp."
        state[dst + "router.weight"] = tensors[block + "gate.weight"]
        if block + "experts.gate_up_proj" in tensors:
            state[dst + "gate_up_proj"] = tensors[block + "experts.gate_up_proj"]
            state[dst + "down_proj"] = tensors[block + "experts.down_proj"]
            continue
        gate, up, down = (
            [tensors[f"{block}experts.{e}.{name}.weight"] for e in range(shape.num_experts)] for name in names
        )
        state[dst + "gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)  # [E, 2I, H]
        state[dst + "down_proj"] = torch.stack(down)  # [E, H, I]
    return state


def moe_report_line(shape: MoeShape, device: torch.device, dtype: torch.dtype, quantized: bool) -> str:
    """The start-up report's line for a mixture-of-experts model."""
    line = f"{shape.describe()}; experts run by {expert_gemm_name(device, dtype)}"
    if device.type == "cpu":
        line += "; decoder layers run in the Python loop (the one-call C++ decoder stack has no routed-experts MLP)"
    if quantized:
        line += (
            f"; experts and routers stay {str(dtype).removeprefix('torch.')} (quantization covers the "
            "attention and dense MLP linears)"
        )
    return line
