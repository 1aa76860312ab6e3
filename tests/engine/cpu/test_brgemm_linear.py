"""bfloat16 linears through oneDNN's brgemm micro-kernel on AMX CPUs (engine/cpu/csrc/brgemm_linear.cpp),
sharing oneDNN's packed weight: equal to nn.Linear up to bfloat16 rounding at row counts around the
kernel's 32-row blocks, a row's output independent of the other rows in the call, the fused SwiGLU
equal to the unfused pair bit for bit, used only where the CPU runs it and only while oneDNN's
buffer is the one it aliases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine.bit_patterns import assert_same_bits_up_to_subnormal_flush, every_16_bit_value
from tests.engine.cpu_support import onednn_bfloat16_or_skip
from tokenloom.engine.cpu import linear as cpu_linear
from tokenloom.engine.cpu.kernels import CpuKernelsUnavailable, load_cpu_kernels
from tokenloom.engine.cpu.layer_ops import CpuLayerOps
from tokenloom.engine.cpu.linear import BRGEMM_BLOCK_N, PackedLinear, brgemm_fast
from tokenloom.engine.models.layer_ops import TORCH_LAYER_OPS
from tokenloom.engine.models.layers import GatedMLP

ROWS = [1, 3, 31, 32, 33, 70]  # around the kernel's 32-row blocks


def _amx_or_skip():
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable as err:
        pytest.skip(f"tokenloom's C++ CPU kernels cannot be built here: {err}")
    if not brgemm_fast():
        pytest.skip(
            "this CPU has no AMX: oneDNN's bfloat16 brgemm micro-kernel cannot run, bfloat16 layers use oneDNN's linear"
        )


def _bf16_linear(in_features, out_features, bias, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return linear


def test_bfloat16_layers_share_onednns_weight_with_brgemm_exactly_when_the_cpu_runs_it():
    onednn_bfloat16_or_skip()
    load_cpu_kernels()
    layer = PackedLinear(_bf16_linear(64, 2 * BRGEMM_BLOCK_N, bias=False))
    assert layer.kernel == ("onednn+brgemm" if brgemm_fast() else "onednn")
    # A width the kernel's column blocks do not divide keeps oneDNN alone on every CPU.
    assert PackedLinear(_bf16_linear(64, BRGEMM_BLOCK_N + 8, bias=False)).kernel == "onednn"
    # The view aliases oneDNN's buffer: never a buffer of its own, never saved.
    assert "brgemm_weight" not in layer.state_dict()


@pytest.mark.parametrize("bias", [False, True])
# (576, 2048): a weight wider than a thread's L2 panel, so the kernel walks several panels per row block.
@pytest.mark.parametrize("in_features,out_features", [(576, 192), (96, 64), (576, 2048)])
def test_matches_nn_linear_at_every_row_count(in_features, out_features, bias):
    _amx_or_skip()
    linear = _bf16_linear(in_features, out_features, bias)
    packed = PackedLinear(linear)
    assert packed.kernel == "onednn+brgemm"
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            reference = x.float() @ linear.weight.float().T + (linear.bias.float() if bias else 0)
            # float32 accumulation, one bfloat16 rounding of the result (plus the bias's own rounding).
            torch.testing.assert_close(packed(x).float(), reference, rtol=1e-2, atol=1e-2, msg=f"{rows} rows")


def test_leading_dimensions_and_empty_batches_keep_their_shape():
    _amx_or_skip()
    linear = _bf16_linear(64, 32, bias=True)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=1e-2, atol=1e-2)
        assert packed(torch.randn(0, 64, dtype=torch.bfloat16)).shape == (0, 32)


@pytest.mark.parametrize("hidden,intermediate", [(96, 2 * BRGEMM_BLOCK_N), (576, 1024)])  # one panel; several
def test_swiglu_equals_gate_up_then_silu_and_mul_bit_for_bit(hidden, intermediate):
    """The fused epilogue against gate_up then torch's silu and product on the same tiles: identical, not merely close."""
    _amx_or_skip()
    torch.manual_seed(1)
    mlp = GatedMLP(hidden, intermediate, "silu", bias=False).to(torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    gate_up = PackedLinear(mlp.gate_up_proj)
    ops = CpuLayerOps()
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, hidden, dtype=torch.bfloat16)
            # The same float32 tiles, rounded where the unfused pair rounds: identical, not merely close.
            expected = TORCH_LAYER_OPS.silu_and_mul(gate_up(x))
            assert torch.equal(gate_up.swiglu(x, ops), expected), f"{rows} rows"


def test_swiglu_activation_is_torchs_silu_for_every_bfloat16_gate_value():
    """All 65,536 bfloat16 bit patterns as gate values (one-hot rows pick them out of the weight),
    up = 1: the fused epilogue's silu equals torch's F.silu of the same gate bit for bit, infinities
    and NaNs included. Two exceptions, both below float32's smallest normal number: AMX reads
    subnormal inputs as zero (the GEMM's gate is 0 there), and a subnormal product comes out as
    zero."""
    _amx_or_skip()
    in_features, intermediate = 32, 2048  # 32 rows x 2048 columns = every bit pattern once
    values = every_16_bit_value(torch.bfloat16, in_features)
    linear = nn.Linear(in_features, 2 * intermediate, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight[:intermediate] = values.T  # gate[r, c] = values[r, c]
        linear.weight[intermediate:] = 1  # up[r, c] = the one-hot row's sum = 1, exactly
    packed = PackedLinear(linear)
    x = torch.eye(in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        gate = packed(x)[:, :intermediate]
        fused = packed.swiglu(x, CpuLayerOps())
        expected = torch.nn.functional.silu(gate)
    gate_is_input = (gate.view(torch.int16) == values.view(torch.int16)) | gate.isnan()
    assert int((~gate_is_input).sum()) == 2 * 2**7 - 1  # the subnormals and -0 (read as +0), nothing else
    assert_same_bits_up_to_subnormal_flush(fused, expected, gate, torch.finfo(torch.float32).tiny)


def test_a_rows_output_does_not_depend_on_the_other_rows_in_the_step():
    """Batch invariance: why the engine runs brgemm at every row count (oneDNN's blocking changes with it)."""
    _amx_or_skip()
    packed = PackedLinear(_bf16_linear(576, 192, bias=True))
    batch = torch.randn(70, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        together = packed(batch)
        for row in (0, 31, 32, 69):
            assert torch.equal(packed(batch[row : row + 1]), together[row : row + 1]), f"row {row}"


def test_onednn_stays_available_beside_brgemm(monkeypatch):
    """bench/roofline.py times oneDNN's GEMM on the same packing by capping brgemm's rows."""
    _amx_or_skip()
    linear = _bf16_linear(96, 64, bias=False)
    packed = PackedLinear(linear)
    monkeypatch.setattr(cpu_linear, "BRGEMM_MAX_ROWS", 0)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=1e-2, atol=1e-2)


def test_a_replaced_onednn_buffer_is_never_read_through_the_old_view():
    _amx_or_skip()
    first, second = _bf16_linear(64, 32, bias=False, seed=1), _bf16_linear(64, 32, bias=False, seed=2)
    packed = PackedLinear(first)
    packed.packed_weight = PackedLinear(second).packed_weight  # what module.to() or a reload would do
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), second(x).float(), rtol=1e-2, atol=1e-2)


def test_the_ops_refuse_wrong_inputs_with_clear_errors():
    _amx_or_skip()
    ops = torch.ops.tokenloom_cpu
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.brgemm_pack_linear_weight(torch.randn(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 CPU"):
        ops.brgemm_pack_linear_weight(torch.randn(32, 64))
    packed = ops.brgemm_pack_linear_weight(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dimension is in_features"):
        ops.brgemm_linear(torch.randn(3, 62, dtype=torch.bfloat16), packed, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16 CPU input"):
        ops.brgemm_linear(torch.randn(3, 64), packed, 64, None)
    # Bytes that are not the kernel's packing give no view (the layer then keeps oneDNN alone).
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    other = ops.brgemm_pack_linear_weight(torch.randn(32, 64, dtype=torch.bfloat16))
    assert ops.brgemm_view_onednn_weight(other.data_ptr(), other.numel() * 2, weight).numel() == 0
    assert ops.brgemm_view_onednn_weight(other.data_ptr(), other.numel() * 2 - 2, weight).numel() == 0


def test_the_start_up_report_has_a_name_for_every_kernel():
    """The weights line says which GEMM the layers got, so a slow run can be read off the log."""
    from tokenloom.engine.runner.model_setup import PACKED_KERNEL_NAMES

    load_cpu_kernels()
    for dtype in (torch.float32, torch.bfloat16):
        if cpu_linear.can_pack(torch.device("cpu"), dtype):
            layer = PackedLinear(_bf16_linear(64, 32, bias=False).to(dtype))
            assert layer.kernel in PACKED_KERNEL_NAMES, dtype
    assert "AMX" in PACKED_KERNEL_NAMES["onednn+brgemm"]
