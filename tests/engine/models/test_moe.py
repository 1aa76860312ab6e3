"""Routed experts (engine/models/moe.py) against a dense reference and transformers' own MoE blocks."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tokenloom.engine.models import moe
from tokenloom.engine.models.layer_ops import TORCH_LAYER_OPS
from tokenloom.engine.models.moe import (
    MoeShape,
    RoutedExperts,
    Routing,
    expert_slice_ends,
    experts_sync_reason,
    grouped_experts,
    grouped_mm_is_sync_free,
    grouped_mm_supported,
    moe_graph_blocker,
    moe_shape,
)
from tokenloom.engine.runner.cuda_graphs import plan_graphs

HIDDEN, NUM_EXPERTS, TOP_K, WIDTH = 64, 8, 2, 48
QWEN3_MOE = dict(
    hidden_size=HIDDEN,
    num_experts=NUM_EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=WIDTH,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
MIXTRAL = dict(
    hidden_size=HIDDEN,
    num_local_experts=NUM_EXPERTS,
    num_experts_per_tok=TOP_K,
    intermediate_size=WIDTH,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GEMMS = [pytest.param(False, id="per-expert-mm"), pytest.param(True, id="grouped-mm")]


def _experts(shape: MoeShape, seed: int = 0) -> RoutedExperts:
    generator = torch.Generator().manual_seed(seed)
    module = RoutedExperts(HIDDEN, shape, "silu")
    for parameter in module.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.2
    return module.requires_grad_(False)  # the engine runs under inference_mode


def _dense_reference(hidden, routing: Routing, experts: RoutedExperts) -> torch.Tensor:
    """Every expert on every token, weighted by a dense [num_tokens, num_experts] routing matrix."""
    dense_weights = torch.zeros(hidden.shape[0], experts.num_experts, dtype=torch.float32)
    dense_weights.scatter_(1, routing.expert_ids, routing.weights.float())
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32)
    for e in range(experts.num_experts):
        gate, up = (hidden @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        out += dense_weights[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T)
    return out


def _shape(family="Qwen3-MoE", top_k=TOP_K, normalize=True, float32_weights=False) -> MoeShape:
    return MoeShape(family, NUM_EXPERTS, top_k, WIDTH, normalize, float32_weights, sparse_layers=(True,))


def _skip_without_grouped_mm(use_grouped_mm: bool) -> None:
    if use_grouped_mm and not grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip(f"torch {torch.__version__} has no CPU grouped_mm kernel for float32: the per-expert loop serves")


@pytest.mark.parametrize("use_grouped_mm", GEMMS)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_equal_dense_reference(use_grouped_mm, top_k):
    _skip_without_grouped_mm(use_grouped_mm)
    experts = _experts(_shape(top_k=top_k))
    hidden = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    routing = experts.router(hidden)
    out = grouped_experts(
        hidden,
        routing,
        experts.gate_up_proj,
        experts.down_proj,
        TORCH_LAYER_OPS.silu_and_mul,
        NUM_EXPERTS,
        use_grouped_mm=use_grouped_mm,
    )
    torch.testing.assert_close(out, _dense_reference(hidden, routing, experts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_grouped_mm", GEMMS)
def test_experts_no_token_is_routed_to_are_never_computed(use_grouped_mm):
    """NaN weights in unrouted experts would poison the output of any dense expert loop."""
    _skip_without_grouped_mm(use_grouped_mm)
    experts = _experts(_shape())
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    routing = experts.router(hidden)
    unused = sorted(set(range(NUM_EXPERTS)) - set(routing.expert_ids.flatten().tolist()))
    assert unused, "5 tokens x top-2 left no expert unrouted; change the seed"
    with torch.no_grad():
        experts.gate_up_proj[unused] = float("nan")
        experts.down_proj[unused] = float("nan")
    out = grouped_experts(
        hidden,
        routing,
        experts.gate_up_proj,
        experts.down_proj,
        TORCH_LAYER_OPS.silu_and_mul,
        NUM_EXPERTS,
        use_grouped_mm=use_grouped_mm,
    )
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("num_pairs", [0, 1, 7, 64, 1000])
def test_expert_slice_ends_equal_the_running_count_of_each_expert(num_pairs):
    """The slice bounds the grouped GEMM reads, from a device-side search: exactly the running sum
    of each expert's pair count, empty experts (repeated ends) and all pairs on one expert included."""
    generator = torch.Generator().manual_seed(num_pairs)
    cases = [
        torch.randint(0, NUM_EXPERTS, (num_pairs,), generator=generator),
        torch.full((num_pairs,), NUM_EXPERTS - 1),
        torch.zeros(num_pairs, dtype=torch.long),
    ]
    for experts in cases:
        sorted_experts = torch.sort(experts).values
        ends = expert_slice_ends(sorted_experts, NUM_EXPERTS)
        assert ends.dtype == torch.int32 and ends.shape == (NUM_EXPERTS,)
        assert ends.tolist() == torch.cumsum(torch.bincount(experts, minlength=NUM_EXPERTS), 0).tolist()


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", ["Qwen3-MoE", "Mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_equal_transformers_sparse_moe_block(family, implementation, dtype):
    if family == "Qwen3-MoE":
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=True)
        block_cls, shape = Qwen3MoeSparseMoeBlock, _shape("Qwen3-MoE")
    else:
        config = transformers.MixtralConfig(**MIXTRAL)
        block_cls, shape = MixtralSparseMoeBlock, _shape("Mixtral", float32_weights=True)
    config._experts_implementation = implementation
    ours = _experts(shape, seed=3).to(dtype)
    theirs = block_cls(config).to(dtype).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.down_proj)
        hidden = torch.randn(2, 19, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
        expected = theirs(hidden).reshape(-1, HIDDEN)
        actual = ours(hidden.reshape(-1, HIDDEN), TORCH_LAYER_OPS)
    # transformers' default (grouped_mm) is the path the engine follows: bit-equal in float32. Its eager
    # loop rounds each expert's bfloat16 share before adding, where both grouped paths sum in float32.
    tolerance = {
        (torch.float32, "grouped_mm"): dict(rtol=0, atol=0),
        (torch.bfloat16, "eager"): dict(rtol=2e-2, atol=2e-2),
    }.get((dtype, implementation), {})
    torch.testing.assert_close(actual, expected, **tolerance)


def test_qwen3_moe_router_is_softmax_then_top_k_renormalised_only_when_asked():
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(5))
    for normalize in (True, False):
        router = _experts(_shape(normalize=normalize)).router
        probs = torch.softmax(hidden @ router.weight.T, dim=-1)
        top, ids = probs.topk(TOP_K, dim=-1)
        routing = router(hidden)
        assert torch.equal(routing.expert_ids, ids)
        torch.testing.assert_close(routing.weights, top / top.sum(-1, keepdim=True) if normalize else top)


def test_mixtral_router_weights_are_a_softmax_over_the_top_k_logits_in_float32():
    router = _experts(_shape("Mixtral", float32_weights=True)).to(torch.bfloat16).router
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    logits = (hidden @ router.weight.T).float()
    top_logits, ids = logits.topk(TOP_K, dim=-1)
    routing = router(hidden)
    assert routing.weights.dtype == torch.float32
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.weights, torch.softmax(top_logits, dim=-1))


def test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    config = transformers.Qwen3MoeConfig(**QWEN3_MOE, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    shape = moe_shape(config, "Qwen3MoeForCausalLM")
    # Routed where (i + 1) % 2 == 0 and i is not listed: layer 1 only (layer 3 is listed).
    assert shape.sparse_layers == (False, True, False, False)
    assert shape.describe().startswith("Qwen3-MoE: 8 experts, top-2, normalised")
    assert moe_shape(transformers.Qwen3Config(), "Qwen3ForCausalLM") is None


def test_mixtral_routes_every_layer_and_always_normalises():
    shape = moe_shape(transformers.MixtralConfig(**MIXTRAL), "MixtralForCausalLM")
    assert shape.sparse_layers == (True, True) and shape.normalize_top_k and shape.float32_weights
    assert shape.expert_intermediate_size == WIDTH


@pytest.mark.parametrize(
    ("dtype", "capability", "sync_free"),
    [
        (torch.bfloat16, (9, 0), True),
        (torch.bfloat16, (10, 0), True),
        (torch.float32, (9, 0), False),
        (torch.float16, (9, 0), False),  # torch's fallback: offs.cpu()
        (torch.bfloat16, (8, 0), False),
        (torch.bfloat16, (8, 9), False),
        (torch.bfloat16, (12, 0), False),
        (torch.bfloat16, None, False),  # a CPU, or ROCm
    ],
)
def test_grouped_mm_runs_without_a_host_read_only_in_bfloat16_on_compute_capability_9_or_10(
    dtype, capability, sync_free
):
    assert grouped_mm_is_sync_free(dtype, capability) is sync_free


def test_the_sync_reason_names_what_to_change_and_is_none_on_the_device_only_kernel():
    assert experts_sync_reason(torch.bfloat16, (9, 0), uses_grouped_mm=True) is None
    assert "in float32" in experts_sync_reason(torch.float32, (9, 0), uses_grouped_mm=False)
    assert "on compute capability 8.0" in experts_sync_reason(torch.bfloat16, (8, 0), uses_grouped_mm=False)
    for reason in (experts_sync_reason(torch.float32, (9, 0), False), experts_sync_reason(torch.bfloat16, None, False)):
        assert "bfloat16 on compute capability 9.x or 10.x" in reason and "graph capture" in reason


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability on which torch's grouped GEMM works."""

    def use(capability):
        moe.prefers_grouped_mm.cache_clear()
        monkeypatch.setattr(moe, "cuda_capability", lambda device: capability)
        monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype: True)
        return torch.device("cuda")

    yield use
    moe.prefers_grouped_mm.cache_clear()  # no fake answer outlives the test


@pytest.mark.parametrize(
    ("dtype", "capability", "graphs"),
    [
        (torch.bfloat16, (9, 0), True),
        (torch.float32, (9, 0), False),
        (torch.bfloat16, (8, 0), False),
    ],
)
def test_cuda_graphs_are_planned_off_for_moe_models_whose_experts_sync_the_host(fake_gpu, dtype, capability, graphs):
    device = fake_gpu(capability)
    assert moe.prefers_grouped_mm(device, dtype) is graphs  # the experts run grouped_mm exactly where graphs are on
    blocker = moe_graph_blocker(_shape(), device, dtype)
    plan = plan_graphs(device, "triton", enforce_eager=False, max_num_seqs=8, capture_blocker=blocker)
    assert plan.enabled is graphs
    if not graphs:
        assert plan.describe().startswith("CUDA graphs: off (the routed experts read their row counts on the host")


def test_dense_models_and_cpus_have_no_moe_graph_blocker():
    assert moe_graph_blocker(None, torch.device("cuda"), torch.float32) is None
    assert moe_graph_blocker(_shape(), torch.device("cpu"), torch.float32) is None
