"""``qfuse.nn.QLinear``: int8/fp8, static/dynamic layers built from float weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qfuse.errors import UnsupportedError
from qfuse.nn import QLinear

FP8 = torch.float8_e4m3fn
CASES = [(torch.int8, True), (torch.int8, False), (FP8, True), (FP8, False)]


def build(dtype, static, out_dtype=torch.float32, **kw):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x = torch.randn(6, 40, generator=g)
    x_scale = x.abs().amax() / (127.5 if dtype == torch.int8 else 448.0) if static else None
    lin = QLinear.from_float(w, b, x_scale=x_scale, x_zero_point=None, dtype=dtype,
                             activation="silu", out_dtype=out_dtype, **kw)
    return lin, x, torch.nn.functional.silu(x @ w.t() + b)


def sqnr(out, ref):
    return 10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum()).item()


@pytest.mark.parametrize(("dtype", "static"), CASES)
def test_close_to_float(device, dtype, static):
    lin, x, ref = build(dtype, static)
    lin, x = lin.to(device), x.to(device)
    out = lin(x).cpu()
    # int8 per-channel/per-tensor keeps ~35-40 dB on Gaussian data, e4m3 (3 mantissa bits) ~25.
    assert sqnr(out, ref) > (30 if dtype == torch.int8 else 20)
    assert lin.dynamic is not static and lin.weight.dtype == dtype


@pytest.mark.parametrize(("dtype", "static"), CASES)
def test_layout_round_trip(dtype, static):
    lin, x, _ = build(dtype, static)
    tensors = {k: v for k, v in lin.state_dict().items()}
    again = QLinear.from_layout(lin.layout(), tensors)
    assert torch.equal(again(x), lin(x))


def test_fp8_output_chains_into_an_fp8_layer():
    lin, x, ref = build(FP8, True, out_dtype=FP8, out_scale=torch.tensor(0.05))  # |y| <= 22.4
    out = lin(x)
    assert out.dtype == FP8
    assert sqnr(out.float() * 0.05, ref) > 20


def test_dtype_casts_keep_fp8_weights_and_float32_scales():
    lin, x, _ = build(FP8, True)
    weight, scale = lin.weight.clone(), lin.scale.clone()
    lin.half()
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == FP8 and lin.scale.dtype == torch.float32
    assert torch.equal(lin.weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(lin.scale, scale)


def test_bad_builds_raise_typed_errors():
    w = torch.randn(4, 8)
    with pytest.raises(UnsupportedError):
        QLinear.from_float(w, None, x_scale=None, x_zero_point=None, dtype=torch.float16)
    with pytest.raises(UnsupportedError):
        QLinear.from_float(w, None, x_scale=None, x_zero_point=torch.tensor(3))


PRESETS = ["int8_static", "fp8_static", "int8_dynamic", "fp8_dynamic"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_converts_and_runs_on_both_backends(device, preset):
    import qfuse

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32)
    cfg = getattr(qfuse.QConfig, preset)()
    prepared = qfuse.prepare(model, cfg, example_inputs=(x,))
    prepared(x)
    qmodel = qfuse.convert(prepared).to(device)
    float_out = model(x)
    x = x.to(device)
    layers = [m for m in qmodel.modules() if isinstance(m, QLinear)]
    assert len(layers) == 2 and all(m.weight.dtype == cfg.dtype for m in layers)
    assert all(m.dynamic == cfg.is_dynamic for m in layers)
    for m in layers:  # the bit-exact contract; the GPU's default GELU is the hardware erf
        m.exact_epilogue = True  # (int8_dynamic's float GELU output differed on the H100)
    with qfuse.use_backend("reference"):
        ref = qmodel(x).cpu()
    with qfuse.use_backend("triton"):  # the interpreter on CPU, the GPU kernels with CUDA
        out = qmodel(x).cpu()
    if cfg.dtype == torch.int8:
        assert torch.equal(out, ref)
    else:  # fp8 GEMMs accumulate in float32, not exactly; see tests/kernels/test_qgemm.py
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    bound = 0.03 if cfg.dtype == torch.int8 else 0.1  # measured: int8 1.3-1.7%, fp8 5.3-5.6%
    assert ((ref - float_out).norm() / float_out.norm()) < bound


def test_deepcopy_and_pickle_drop_launch_plans():
    import copy
    import pickle

    lin = QLinear.from_float(torch.randn(8, 16), None, x_scale=torch.tensor(0.05),
                             x_zero_point=None)
    lin._launch_cache[("bucket",)] = object()  # stands for a plan holding a compiled kernel
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone._launch_cache == {} and torch.equal(clone.weight, lin.weight)
    x = torch.randn(3, 16)
    assert torch.equal(copy.deepcopy(lin)(x), lin(x))


def _asym(device="cpu", bias=True, out_dtype=torch.int8):
    """An asymmetric int8 layer (GELU-like input: mostly positive, zero point near -128)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 72, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.nn.functional.gelu(torch.randn(9, 72, generator=g) * 2)
    lo, hi = x.min().item(), x.max().item()
    x_scale = torch.tensor((hi - lo) / 255.0)
    zp = torch.tensor(round(-128 - lo / x_scale.item()), dtype=torch.int32)
    lin = QLinear.from_float(w, b, x_scale=x_scale, x_zero_point=zp, dtype=torch.int8,
                             activation="gelu", out_dtype=out_dtype,
                             out_scale=torch.tensor(0.05) if out_dtype == torch.int8 else None,
                             out_zero_point=torch.tensor(-20) if out_dtype == torch.int8 else None)
    return lin.to(device), x.to(device)


@pytest.mark.parametrize("bias", [True, False])
def test_zero_point_correction_is_folded_into_the_bias(bias):
    from qfuse.ops import reference

    lin, x = _asym(bias=bias, out_dtype=torch.float32)
    assert lin.weight_sum is None and lin.bias is not None
    # The unfolded form (int32 correction on the accumulator) gives the same numbers up to
    # float32 rounding of the two orders of operations.
    wsum = lin.weight.sum(dim=1, dtype=torch.int32)
    corr = lin.x_zero_point.double() * wsum.double() * lin.scale.double()
    unfolded_bias = (lin.bias.double() + corr).float()
    ref = reference.qlinear(x, dataclasses.replace(lin.describe(), bias=unfolded_bias,
                                                   weight_sum=wsum))
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)


def test_format_1_buffers_load_folded():
    """A file written before the fold carries ``weight_sum`` and the plain bias."""
    lin, x = _asym()
    tensors = {k: v.clone() for k, v in lin.state_dict().items()}
    wsum = lin.weight.sum(dim=1, dtype=torch.int32)
    old_bias = (lin.bias.double() + lin.x_zero_point.double() * wsum.double()
                * lin.scale.double()).float()
    layout = lin.layout() | {"buffers": sorted([*lin.layout()["buffers"], "weight_sum"])}
    again = QLinear.from_layout(layout, tensors | {"bias": old_bias, "weight_sum": wsum})
    assert again.weight_sum is None
    assert (again.bias - lin.bias).abs().max() < 1e-5
    assert (again(x).int() - lin(x).int()).abs().max() <= 1


def test_folded_zero_point_kernel_matches_reference(device):
    """The Triton kernel (the interpreter on CPU CI) on the folded buffers: the reference's bits."""
    from qfuse.kernels.gemm import dispatch as qgemm
    from qfuse.ops import reference

    lin, x = _asym()
    lin.exact_epilogue = True  # the IEEE-exact GELU on the GPU too
    ref = reference.qlinear(x, lin.describe())
    out = qgemm.qlinear(x.to(device), lin.to(device).describe())
    assert torch.equal(out.cpu(), ref)


def test_output_quantized_for_int8_and_fp8_hand_offs():
    assert build(torch.int8, True, out_dtype=torch.int8,
                 out_scale=torch.tensor(0.05))[0].output_quantized
    assert build(FP8, True, out_dtype=FP8, out_scale=torch.tensor(0.05))[0].output_quantized
    assert not build(FP8, True)[0].output_quantized


def test_the_layer_call_is_built_once_and_follows_the_layer():
    """The eager forward reads one kept ``GemmCall``; setting an attribute, replacing a buffer
    or moving the layer builds it again, an in-place load keeps it."""
    lin = QLinear.from_float(torch.randn(8, 16), torch.randn(8), x_scale=torch.tensor(0.05),
                             x_zero_point=None)
    call = lin.layer_call()
    assert lin.layer_call() is call and call.weight is lin.weight and call.act == "none"
    lin.load_state_dict(lin.state_dict())
    assert lin.layer_call() is call
    lin.activation = "relu"
    assert lin.layer_call() is not call and lin.layer_call().act == "relu"
    call = lin.layer_call()
    lin._buffers["bias"] = torch.zeros(8)  # as export.tensors.set_tensor writes
    assert lin.layer_call().bias is lin._buffers["bias"]
    x = torch.randn(3, 16)
    assert torch.equal(lin(x), torch.relu(lin(x)))
    lin.exact_epilogue = True
    assert not lin.layer_call().fast_act
    call = lin.layer_call()
    lin.to(torch.float64)  # buffers keep their dtypes; the description is rebuilt
    assert "_kept_call" not in lin.__dict__ and lin.layer_call().scale.dtype == torch.float32
