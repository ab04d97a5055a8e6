"""``qfuse.kernels.conv.implicit`` against ``ops.reference.qconv2d``: every conv variant, fuzzed.

On CPU the kernels run in the Triton interpreter (tiny shapes: it is slow); with CUDA for real.
- int8: int8 outputs identical, float outputs identical (same IEEE-exact epilogue order).
- fp8: the reference sums exactly (float64), the kernel in float32 or at the Hopper tensor core's
  precision: outputs agree to that accumulation's bound (``qfuse.testing``) plus one rounding.
"""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.conv import implicit as conv
from qfuse.kernels.conv.call import ConvCall, output_size
from qfuse.ops import reference
from qfuse.testing import (
    ACT_SLOPE,
    accumulation_eps,
    conv_magnitude,
    describe_excess,
    fp8_accumulation,
    output_excess,
)
from tests.optional import given, settings, st

FP8 = torch.float8_e4m3fn


def make_case(device, *, n=2, c_in=8, c_out=16, hw=(6, 5), k=3, stride=1, padding=1,
              dilation=1, groups=1, qdtype=torch.int8, x_quantized=False, zp=False,
              act="none", post_act="none", residual=False, out_dtype=torch.int8, bias=True,
              channels_last=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (c_out, c_in // groups, k, k)
    if qdtype == FP8:
        w = (torch.randn(shape, generator=g) * 64).clamp(-448, 448).to(FP8)
    else:
        w = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    w = conv.pack_weight(w)
    x = torch.randn(n, c_in, *hw, generator=g) * 2.0
    x_inv = torch.tensor(40.0)
    x_zp = torch.tensor(7, dtype=torch.int32) if zp else None
    if x_quantized:
        x = reference._quantize_input(x, x_inv, x_zp, qdtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    oh, ow = output_size(*hw, (k, k), [stride] * 2, [padding] * 2, [dilation] * 2)
    reduction = (c_in // groups) * k * k
    # Scales that put the float result around 1, where every activation bends.
    scale = (torch.rand(c_out, generator=g) + 0.5) * (2.0 / (40.0 * 64 * reduction**0.5))
    out_q = out_dtype in (torch.int8, FP8)
    res = torch.randn(n, c_out, oh, ow, generator=g).to(torch.bfloat16) if residual else None
    res_q = {}
    if residual == "quantized":  # handed over int8/fp8 by the conv that wrote it
        res_zp = torch.tensor(-5, dtype=torch.int32) if zp and qdtype == torch.int8 else None
        res = reference._quantize_input(res.float(), torch.tensor(20.0), res_zp, qdtype)
        res = res.contiguous(memory_format=torch.channels_last)
        res_q = dict(residual_scale=torch.tensor(0.05), residual_zero_point=res_zp)
    args = dict(
        x=x,
        weight=w,
        scale=scale,
        bias=torch.randn(c_out, generator=g) if bias else None,
        x_inv_scale=x_inv,
        x_zero_point=x_zp,
        residual=res,
        out_inv_scale=torch.tensor(25.0 if out_dtype == torch.int8 else 100.0) if out_q else None,
        out_zero_point=torch.tensor(-3, dtype=torch.int32) if out_dtype == torch.int8 and zp
        else None,
        act=act,
        out_dtype=out_dtype,
        stride=[stride] * 2,
        padding=[padding] * 2,
        dilation=[dilation] * 2,
        groups=groups,
        post_act=post_act,
        **res_q,
    )
    return {k_: v.to(device) if isinstance(v, torch.Tensor) else v for k_, v in args.items()}


def split(args: dict) -> tuple:
    """``(x, call, residual)`` of a ``make_case`` dict (``ConvCall``'s fields and the per-call
    ``x`` and ``residual``, by name), as the kernels and the reference take them."""
    fields = {k: v for k, v in args.items() if k not in ("x", "residual")}
    return args["x"], ConvCall(**fields), args["residual"]


def run(args: dict, **kw) -> torch.Tensor:
    """The kernels on a ``make_case`` dict."""
    return conv.qconv2d(*split(args), **kw)


def check(args, **kw) -> None:
    out = run(args, **kw)
    on_gpu = out.is_cuda
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    ref = reference.qconv2d(*split(cpu))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    out = out.cpu()
    if args["weight"].dtype == torch.int8:
        assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
        return
    # fp8: the bound follows from how the kernel sums (qfuse/testing.py): float32 in the
    # interpreter and with a promotion interval, the tensor core's ~14 bits with Triton's sm_90
    # default, as a fraction of the magnitude sum, through the epilogue's slopes.
    excess = output_excess(out, ref, fp8_y_error(cpu, args["x"].device, kw.get("fp8_promote") or 0),
                           cpu["out_inv_scale"].item() if out.dtype == FP8 else None)
    assert (excess <= 1).all(), describe_excess(out, ref, excess)
    if out.dtype == FP8:  # a one-step difference is a rounding boundary, not the rule
        assert (out.double() != ref.double()).float().mean() < (0.05 if on_gpu else 0.02)


def fp8_y_error(cpu: dict, device: torch.device, fp8_promote: int = 0) -> torch.Tensor:
    """Bound on |y_kernel - y_ref| before the output rounding, per output (channels dim 1)."""
    w = cpu["weight"]
    xq = reference._quantize_input(cpu["x"], cpu["x_inv_scale"], None, FP8)
    mag = conv_magnitude(xq, w, cpu["stride"], cpu["padding"], cpu["dilation"], cpu["groups"])
    mode = fp8_accumulation(device, fp8_promote)
    eps = accumulation_eps(mode, w.shape[1] * w.shape[2] * w.shape[3])
    slope = ACT_SLOPE[cpu["act"]] * ACT_SLOPE[cpu["post_act"]]
    return eps * slope * mag * cpu["scale"].double().abs().reshape(1, -1, 1, 1)

VARIANTS = {
    "1x1": dict(k=1, padding=0),
    "3x3": dict(),
    "3x3-s2": dict(stride=2),
    "5x5": dict(k=5, padding=2, c_in=4),
    "7x7-s2-stem": dict(k=7, stride=2, padding=3, c_in=3, hw=(9, 8)),
    "dilated": dict(dilation=2, padding=2),
    "grouped": dict(groups=2, c_out=8),
    "depthwise": dict(groups=8, c_out=8),
    "depthwise-5x5-s2": dict(groups=8, c_out=8, k=5, padding=2, stride=2),
    "zero-point": dict(zp=True),
    "zero-point-depthwise": dict(zp=True, groups=8, c_out=8),
    "quantized-in": dict(x_quantized=True),
    "quantized-in-zp-padding": dict(x_quantized=True, zp=True),
    "residual-post-relu": dict(residual=True, post_act="relu", out_dtype=torch.float32),
    "residual-quantized": dict(residual="quantized", post_act="relu"),
    "residual-quantized-zp-1x1": dict(residual="quantized", zp=True, k=1, padding=0),
    "residual-quantized-depthwise": dict(residual="quantized", groups=8, c_out=8, act="relu6"),
    "nchw-input": dict(channels_last=False),
    "bf16-out": dict(out_dtype=torch.bfloat16, act="silu"),
    "no-bias": dict(bias=False, act="relu6"),
    "k-over-block": dict(c_in=40, k=1, padding=0, act="gelu"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_variant_matches_reference(device, name, qdtype):
    spec = dict(VARIANTS[name])
    if qdtype == FP8:
        if spec.get("zp"):
            pytest.skip("fp8 is symmetric: no zero point")
        if spec.get("out_dtype", torch.int8) == torch.int8:
            spec["out_dtype"] = FP8
    check(make_case(device, qdtype=qdtype, **spec))


@pytest.mark.parametrize("name", ["3x3-s2", "depthwise", "zero-point", "7x7-s2-stem"])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("prequantize", [True, False], ids=["separate-pass", "prologue"])
def test_input_quantization_paths_agree(device, name, qdtype, prequantize):
    spec = dict(VARIANTS[name])
    if qdtype == FP8 and spec.pop("zp", False):
        pytest.skip("fp8 is symmetric: no zero point")
    check(make_case(device, qdtype=qdtype, out_dtype=torch.float32, **spec),
          prequantize_input=prequantize)


@pytest.mark.parametrize(
    "spec",
    [dict(k=7, stride=2, padding=3, c_in=3, hw=(9, 8)), dict(c_in=1, zp=True),
     dict(c_in=5, x_quantized=True, zp=True, dilation=2, padding=2), dict(c_in=3, n=1, hw=(3, 7))],
    ids=["stem-7x7-s2", "1-channel-zp", "quantized-in-zp-dilated", "odd-size"],
)
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("stem_path", conv.STEM_PATHS)
def test_stem_paths_match_reference(device, spec, qdtype, stem_path):
    """Few input channels: the stem kernel (default), the patch-buffer GEMM and the implicit
    GEMM's flat-K path all give the reference's numbers (zero point at padding taps and past K
    included)."""
    spec = dict(spec)
    if qdtype == FP8:
        spec.pop("zp", None)  # fp8 is symmetric
    check(make_case(device, qdtype=qdtype, out_dtype=FP8 if qdtype == FP8 else torch.int8,
                    act="relu", **spec), stem_path=stem_path)


@pytest.mark.parametrize("act", ["relu", "relu6", "hardswish", "gelu", "gelu_tanh", "silu"])
def test_activations_bit_exact(device, act):
    check(make_case(device, act=act, k=1, padding=0, out_dtype=torch.float32))
    check(make_case(device, post_act=act, residual=True, groups=8, c_out=8))


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 2),
    c_in=st.sampled_from([1, 3, 8, 17]),
    c_out=st.integers(1, 20),
    h=st.integers(1, 7),
    w=st.integers(1, 7),
    k=st.sampled_from([1, 3, 5]),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    depthwise=st.booleans(),
    qdtype=st.sampled_from([torch.int8, FP8]),
    seed=st.integers(0, 1000),
)
def test_shape_fuzz(n, c_in, c_out, h, w, k, stride, dilation, depthwise, qdtype, seed):
    padding = (k // 2) * dilation
    groups = c_in if depthwise else 1
    c_out = c_in if depthwise else c_out
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = FP8 if qdtype == FP8 else torch.int8
    check(make_case(device, n=n, c_in=c_in, c_out=c_out, hw=(h, w), k=k, stride=stride,
                    padding=padding, dilation=dilation, groups=groups, qdtype=qdtype,
                    out_dtype=out, act="relu", seed=seed))


def test_empty_batch(device):
    args = make_case(device, n=0)
    assert run(args).shape == (0, 16, 6, 5)


REAL_SHAPES = [
    dict(n=8, c_in=64, c_out=64, hw=(56, 56)),
    dict(n=4, c_in=256, c_out=64, hw=(28, 28), k=1, padding=0),
    dict(n=4, c_in=128, c_out=128, hw=(28, 28), stride=2),
    dict(n=2, c_in=3, c_out=64, hw=(64, 64), k=7, stride=2, padding=3),
    dict(n=4, c_in=96, c_out=96, hw=(28, 28), groups=96, k=5, padding=2),
    dict(n=1, c_in=512, c_out=512, hw=(7, 7)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_gpu_real_shapes(shape, qdtype):
    out = FP8 if qdtype == FP8 else torch.int8
    check(make_case("cuda", qdtype=qdtype, out_dtype=out, act="relu", **shape))
    check(make_case("cuda", qdtype=qdtype, out_dtype=torch.float32, residual=True,
                    post_act="relu", x_quantized=True, **shape))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL_SHAPES[:4] + REAL_SHAPES[5:])  # no depthwise: no dot
def test_gpu_real_shapes_promoted_fp8(shape):
    """fp8 with float32 promotion every tile (``fp8_promote``, capped at block_k): held to the
    float32-accumulation bound, which Triton's in-place sm_90 default missed near zero."""
    check(make_case("cuda", qdtype=FP8, out_dtype=FP8, act="relu", **shape), fp8_promote=128)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("promote", [32, 128])
def test_fp8_promote_keeps_the_numbers(device, qdtype, promote):
    """A schedule choice only: int8 stays bit-exact, fp8 within its bound (the interpreter sums
    in float32 either way; Triton takes the argument for fp8 dots only)."""
    out = FP8 if qdtype == FP8 else torch.int8
    check(make_case(device, qdtype=qdtype, out_dtype=out, act="relu", c_in=40), fp8_promote=promote)


def test_fp8_promote_must_be_whole_wgmmas_within_the_tile():
    from qfuse.errors import UnsupportedError

    assert conv.ConvConfig(64, 64, 128, 4, 3, fp8_promote=64).fp8_promote == 64
    for bad in (48, 256, -32):
        with pytest.raises(UnsupportedError, match="fp8_promote"):
            conv.ConvConfig(64, 64, 128, 4, 3, fp8_promote=bad)


def test_quantized_residual_needs_its_scale():
    from qfuse.errors import UnsupportedError
    from qfuse.ops.qconv2d import qconv2d as op

    args = make_case("cpu", residual="quantized")
    args.pop("residual_scale")
    args["activation"] = args.pop("act")
    args["post_activation"] = args.pop("post_act")
    with pytest.raises(UnsupportedError, match="residual_scale"):
        op(**args)


@pytest.mark.parametrize("channels_last", [True, False], ids=["nhwc", "nchw"])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_prequantize_matches_reference(device, channels_last, qdtype):
    # 96x96 NCHW: H*W past 8192, so rows of W; channels-last: rows of W*C
    x = torch.randn(2, 3, 96, 96) * 3
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    inv, zp = torch.tensor(30.0), torch.tensor(3, dtype=torch.int32)
    zp = zp if qdtype == torch.int8 else None
    q = conv.prequantize(x.to(device), qdtype, inv.to(device),
                         zp.to(device) if zp is not None else None)
    ref = reference._quantize_input(x, inv, zp, qdtype)
    assert q.stride() == x.stride()
    assert torch.equal(q.cpu().float(), ref.float())
