"""Prepacked CPU linears (engine/cpu/linear.py): float32 through MKL's packed GEMM, bfloat16
through oneDNN; both equal nn.Linear up to rounding at every row count one packing serves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine.cpu_support import onednn_bfloat16_or_skip
from tokenloom.engine.cpu import linear as cpu_linear
from tokenloom.engine.cpu.linear import PackedLinear, mkl_packing_available, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

ROWS = [1, 2, 7, 16, 63, 64, 65, 200, 513]


def _linear(in_features, out_features, bias, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.fixture(params=["mkl", "onednn"])
def float32_gemm(request, monkeypatch):
    """Both float32 kernels on every CPU (the engine picks one by vendor: float32_uses_mkl)."""
    if request.param == "mkl" and not mkl_packing_available():
        pytest.skip("this torch has no MKL packed GEMM: float32 layers use oneDNN (the onednn case)")
    monkeypatch.setattr(cpu_linear, "FLOAT32_GEMM", request.param)
    return request.param


def test_float32_layers_use_mkl_on_intel_cpus_where_torch_has_it():
    # torch's x86 wheels (CI's) carry MKL; a torch without it, or a CPU of another vendor, uses oneDNN.
    layer = PackedLinear(_linear(48, 40, bias=False))
    intel = cpu_linear.cpu_vendor() == "GenuineIntel"
    assert layer.kernel == ("mkl" if intel and mkl_packing_available() else "onednn")
    assert cpu_linear.float32_uses_mkl() == (layer.kernel == "mkl")


def test_the_float32_kernel_follows_the_cpu_vendor(monkeypatch):
    if not mkl_packing_available():
        pytest.skip("this torch has no MKL packed GEMM: float32 layers use oneDNN on every CPU")
    for vendor, kernel in (("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
        assert PackedLinear(_linear(48, 40, bias=False)).kernel == kernel, vendor


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(576, 1728), (1536, 576), (37, 100)])
def test_float32_matches_nn_linear_at_every_row_count(in_features, out_features, bias, float32_gemm):
    linear = _linear(in_features, out_features, bias)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5, msg=f"{rows} rows")


def test_leading_dimensions_and_empty_batches_keep_their_shape(float32_gemm):
    linear = _linear(32, 24, bias=True)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        x = torch.randn(3, 5, 32)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
        assert packed(torch.randn(0, 32)).shape == (0, 24)


def test_moving_or_saving_the_module_never_copies_the_mkl_packing(monkeypatch):
    if not mkl_packing_available():
        pytest.skip("this torch has no MKL packed GEMM: nothing MKL-packed to protect")
    monkeypatch.setattr(cpu_linear, "FLOAT32_GEMM", "mkl")
    linear = _linear(64, 48, bias=True)
    packed = PackedLinear(linear)
    assert packed.kernel == "mkl"
    address = packed.mkl_packed_weight.data_ptr()
    packed.to(torch.float32)
    assert packed.mkl_packed_weight.data_ptr() == address  # MKL's packed data must never move
    assert "mkl_packed_weight" not in packed.state_dict()
    x = torch.randn(9, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_bfloat16_layers_the_brgemm_kernel_cannot_take_use_onednn():
    onednn_bfloat16_or_skip()
    # 48 output columns: not a multiple of the brgemm kernel's 32-column blocks (tests/engine/cpu/test_brgemm_linear.py).
    linear = _linear(64, 48, bias=False, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.kernel == "onednn"
    with torch.inference_mode():
        x = torch.randn(20, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=2e-2, atol=2e-2)


def test_pack_linears_swaps_plain_linears_only():
    class Quantized(nn.Linear):  # stands for bitsandbytes' subclasses, which hold other formats
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), Quantized(4, 4))
    pack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert type(model[2]) is Quantized


def test_the_op_refuses_a_wrong_input_with_a_clear_error():
    if not mkl_packing_available():
        pytest.skip("this torch has no MKL packed GEMM: the op is never called")
    ops = torch.ops.tokenloom_cpu
    packed = ops.mkl_pack_linear_weight(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="last dimension is in_features"):
        ops.mkl_packed_linear(torch.randn(3, 15), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.mkl_packed_linear(torch.randn(3, 16, dtype=torch.bfloat16), packed, 16, 8, None)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        ops.mkl_pack_linear_weight(torch.randn(8, 16, dtype=torch.float64))


def test_bfloat16_layers_stay_plain_where_onednn_cannot_pack_them(monkeypatch):
    """On an AVX2-only CPU oneDNN's bfloat16 reorder raises; the loader must not call it there
    (the bfloat16 engine tests exercise this for real on such a CPU)."""
    monkeypatch.setattr(cpu_linear, "onednn_bfloat16_supported", lambda: False)
    cpu = torch.device("cpu")
    assert not cpu_linear.can_pack(cpu, torch.bfloat16) and cpu_linear.can_pack(cpu, torch.float32)


def test_an_explicit_bfloat16_on_a_cpu_that_emulates_it_says_what_to_change(monkeypatch, caplog):
    from tokenloom.engine.runner import device

    monkeypatch.setattr(device, "onednn_bfloat16_supported", lambda: False)
    assert device.resolve_dtype("bfloat16", None, torch.device("cpu")) is torch.bfloat16
    assert 'dtype = "auto"' in caplog.text and "slower than float32" in caplog.text
