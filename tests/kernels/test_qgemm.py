"""``qfuse.kernels.gemm.dispatch`` against ``qfuse.ops.reference``: every variant, fuzzed shapes.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py); with CUDA it runs for real.
- int8 GEMM: int8 outputs identical; float outputs within 1e-6 relative (the epilogue repeats the
  reference's IEEE-exact operation order, so in practice they are identical too).
- fp8 GEMM: the reference sums exactly (float64), the kernel in float32 / tensor-core order, so
  float outputs agree to that accumulation's rounding and quantized outputs may differ by one
  step where the exact value sits on a rounding boundary (counted, and bounded, below).
"""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.gemm import dispatch as qgemm
from qfuse.kernels.gemm.call import GemmCall
from qfuse.kernels.schedules import GemmConfig
from qfuse.ops import reference
from tests.optional import given, settings, st

FP8 = torch.float8_e4m3fn
ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
FLOAT_OUTS = (torch.float32, torch.bfloat16, torch.float16)
OUTS = (torch.int8, FP8, *FLOAT_OUTS)


def make_case(M, K, N, device, *, qdtype=torch.int8, x_mode="static", zp=False, act="none",
              residual=False, out_dtype=torch.float32, bias=True, seed=0):
    """Random inputs for one qlinear call, by name: ``GemmCall``'s fields and the per-call
    ``x``, ``x_scale`` and ``residual`` (``split`` makes the call).

    ``x_mode``: "static" (float x, per-tensor scale), "channels" (float x, one inverse scale per
    input channel: SmoothQuant's prologue), "quantized" (int8/fp8 x), "dynamic" (float x,
    per-token scales computed by the op), "rows" (quantized x with given per-token scales).
    """
    g = torch.Generator().manual_seed(seed)
    if qdtype == FP8:
        w = (torch.randn(N, K, generator=g) * 64).clamp(-448, 448).to(FP8)
    else:
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    x = torch.randn(M, K, generator=g) * 2.0
    x_inv = torch.tensor(40.0)
    if x_mode == "channels":
        x_inv = torch.rand(K, generator=g) * 40.0 + 20.0
    x_scale = None
    if x_mode in ("quantized", "rows"):
        x = reference._quantize_input(x, x_inv, None, qdtype)
    if x_mode == "rows":
        x_scale = torch.rand(M, generator=g) + 0.5
    # Scales that put the float result around 1, where every activation bends.
    acc_std = (reference.fp8_matmul(reference._quantize_input(x, x_inv, None, qdtype), w)
               .std().item() if M * N > 1 else 1.0) or 1.0
    scale = (torch.rand(N, generator=g) + 0.5) * (2.0 / acc_std)
    if x_mode == "dynamic":
        scale = scale * 40.0 * 127.5 / 6.0  # per-token scales are ~ amax / 127.5, amax ~ 6
    out_q = out_dtype in (torch.int8, FP8)
    args = dict(
        x=x,
        weight=w,
        scale=scale,
        bias=torch.randn(N, generator=g) if bias else None,
        x_inv_scale=x_inv if x_mode in ("static", "channels") else None,
        x_zero_point=torch.tensor(7, dtype=torch.int32) if zp else None,
        weight_sum=w.sum(dim=1, dtype=torch.int32) if zp else None,
        residual=torch.randn(M, N, generator=g).to(torch.bfloat16) if residual else None,
        out_inv_scale=torch.tensor(25.0 if out_dtype == torch.int8 else 100.0) if out_q else None,
        out_zero_point=torch.tensor(-3, dtype=torch.int32) if out_dtype == torch.int8 and zp
        else None,
        act=act,
        out_dtype=out_dtype,
        x_scale=x_scale,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def split(args: dict) -> tuple:
    """``(x, call, x_scale, residual)`` of a ``make_case`` dict, as the kernels take them."""
    fields = {k: v for k, v in args.items() if k not in ("x", "x_scale", "residual")}
    return args["x"], GemmCall(**fields), args["x_scale"], args["residual"]


def run(args: dict, **kw) -> torch.Tensor:
    """The kernel on a ``make_case`` dict."""
    return qgemm.qlinear(*split(args), **kw)


def reference_out(args: dict) -> torch.Tensor:
    """The CPU reference on a ``make_case`` dict."""
    return reference.qlinear(*split({k: v.cpu() if isinstance(v, torch.Tensor) else v
                                     for k, v in args.items()}))


def dequant(t: torch.Tensor, args) -> torch.Tensor:
    if t.dtype not in (torch.int8, FP8):
        return t.double()
    zp = args["out_zero_point"]
    zp = zp.cpu().double() if zp is not None else 0.0
    return (t.double() - zp) / args["out_inv_scale"].cpu().double()


def check(args, config: GemmConfig | None = None):
    """Kernel vs reference; returns the kernel output (on CPU)."""
    out = run(args, config=config).cpu()
    ref = reference_out(args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if args["weight"].dtype == torch.int8:
        if out.dtype == torch.int8:
            assert torch.equal(out, ref), f"{(out != ref).sum()} int8 values differ"
        elif out.dtype == FP8:
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        else:
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-6, atol=1e-6)
        return out
    # fp8 GEMM: float32 accumulation in the interpreter (~1e-6 relative). On Hopper, Triton
    # lets fp8 wgmma accumulate at the tensor core's own reduced precision
    # (max_num_imprecise_acc = 2**30 for sm_90), so the GPU bound is 1e-4.
    tol = 1e-4 if out.is_cuda or torch.cuda.is_available() else 2e-6
    o, r = dequant(out, args), dequant(ref, args)
    if out.dtype in (torch.int8, FP8):
        step = (r.abs() * 2.0**-3).clamp_min(2.0**-9) if out.dtype == FP8 else 1.0
        step = step / args["out_inv_scale"].cpu().double() if out.dtype == torch.int8 else step
        diff = (o - r).abs()
        assert (diff <= step * 1.01 + 1e-12).all(), "a quantized output is off by more than a step"
        assert (diff > 0).float().mean() < 0.02
    else:
        err = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < tol + (4e-3 if out.dtype != torch.float32 else 0.0), err
    return out


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("out_dtype", OUTS, ids=str)
def test_epilogue_variants(device, qdtype, act, out_dtype):
    out = check(make_case(19, 70, 37, device, qdtype=qdtype, act=act, out_dtype=out_dtype,
                          residual=True))
    if out_dtype in (torch.int8, FP8):  # the data exercise the requant range, not one value
        assert out.view(torch.uint8).unique().numel() > 20


INT8_INPUTS = [(m, zp) for m in ("static", "channels", "quantized") for zp in (False, True)]
INT8_INPUTS += [("dynamic", False), ("rows", False)]  # dynamic quantization is symmetric


@pytest.mark.parametrize(("x_mode", "zp"), INT8_INPUTS)
@pytest.mark.parametrize("out_dtype", [torch.int8, torch.bfloat16], ids=str)
def test_int8_input_variants(device, x_mode, zp, out_dtype):
    check(make_case(5, 33, 21, device, x_mode=x_mode, zp=zp, act="relu", out_dtype=out_dtype,
                    bias=not zp))


@pytest.mark.parametrize("x_mode", ["static", "channels", "quantized", "dynamic", "rows"])
def test_fp8_input_variants(device, x_mode):
    check(make_case(6, 48, 24, device, qdtype=FP8, x_mode=x_mode, act="gelu",
                    out_dtype=torch.float32))


SCHEDULES = [
    GemmConfig(16, 32, 32, split_k=3, num_stages=2),  # split-K with an uneven last split
    GemmConfig(16, 64, 64, split_k=4, num_stages=2),  # a split with no K tiles at all
    GemmConfig(32, 32, 32, group_m=2, prequantize=True, num_stages=2),
    GemmConfig(32, 64, 32, epi_split=2, num_stages=2),  # epilogue in two column halves
    # persistent: 3 programs (the interpreter's count) walk 6 tiles, rows/columns past the edge
    GemmConfig(16, 32, 64, group_m=2, num_stages=2, persistent=True),
    GemmConfig(32, 64, 32, epi_split=2, num_stages=2, persistent=True),
]


@pytest.mark.parametrize("cfg", SCHEDULES, ids=["split3", "split4_empty", "prequant", "epi2",
                                                "persistent", "persistent_epi2"])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_schedules(device, cfg, qdtype):
    # M over two row blocks, N over the column block, K a few blocks with a ragged tail.
    for out_dtype, x_mode in ((torch.int8, "static"), (torch.float32, "channels")):
        check(make_case(37, 150, 70, device, qdtype=qdtype, x_mode=x_mode, act="silu",
                        out_dtype=out_dtype, residual=True), cfg)
    if qdtype == torch.int8:  # zero points under split-K, the split epilogue, persistent tiles
        for x_mode in ("static", "quantized"):
            check(make_case(37, 150, 70, device, x_mode=x_mode, act="gelu",
                            out_dtype=torch.int8, zp=True), cfg)
    # Twice in a row: split-K counters must have reset themselves.
    a = make_case(20, 150, 40, device, qdtype=qdtype, out_dtype=torch.int8, seed=3)
    torch.testing.assert_close(run(a, config=cfg), run(a, config=cfg), rtol=0, atol=0)


def test_multi_tile_and_k_tail(device):
    check(make_case(67, 301, 131, device, act="gelu", out_dtype=torch.int8, zp=True))


def test_m_zero(device):
    out = run(make_case(1, 8, 4, device) | {"x": torch.empty(0, 8, device=device)})
    assert out.shape == (0, 4)


@settings(max_examples=10, deadline=None)
@given(
    M=st.integers(1, 40),
    K=st.integers(1, 160),
    N=st.integers(1, 80),
    qdtype=st.sampled_from([torch.int8, FP8]),
    x_mode=st.sampled_from(["static", "channels", "quantized", "dynamic", "rows"]),
    act=st.sampled_from(ACTS),
    residual=st.booleans(),
    out_dtype=st.sampled_from(OUTS),
    seed=st.integers(0, 2**16),
)
def test_fuzz(M, K, N, qdtype, x_mode, act, residual, out_dtype, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(make_case(M, K, N, device, qdtype=qdtype, x_mode=x_mode, act=act, residual=residual,
                    out_dtype=out_dtype, seed=seed))
