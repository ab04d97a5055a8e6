"""``qfuse::layer_norm_quant``: Triton (interpreter on CPU, real on the GPU) against the reference
(``F.layer_norm`` + the reference quantizer, i.e. the unfused graph)."""

from __future__ import annotations

import pytest
import torch

import qfuse.ops  # noqa: F401
from qfuse.kernels.layernorm import layer_norm_quant as kernel
from qfuse.ops.layernorm import INTERPRETED, _reference
from tests.optional import given, settings, st

FP8 = torch.float8_e4m3fn


def case(M, D, dtype, qdtype, zp, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, D, generator=g) * 3 + 1).to(dtype)
    w = torch.rand(D, generator=g) + 0.5
    b = torch.randn(D, generator=g) * 0.1
    inv = torch.tensor(30.0 if qdtype == torch.int8 else 100.0)
    z = torch.tensor(5, dtype=torch.int32) if zp else None
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return to(x), to(w), to(b), 1e-12, to(inv), to(z), qdtype


def check(y, q, ry, rq, dtype, qdtype):
    """The same norm up to float rounding: float outputs close, quantized values at most one
    step (int8) or one e4m3 grid step (fp8) apart, on at most 5% of them."""
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.cpu().float(), ry.float(), rtol=tol, atol=tol)
    if qdtype == torch.int8:
        diff = (q.cpu().int() - rq.int()).abs()
    else:
        diff = (q.cpu().float() - rq.float()).abs() / rq.float().abs().clamp(min=2**-9) * 8
    assert diff.max() <= 1
    assert (diff > 0).float().mean() <= 0.05


@settings(max_examples=12, deadline=None)
@given(M=st.integers(1, 9), D=st.sampled_from([8, 24, 48, 100]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       qdtype=st.sampled_from([torch.int8, FP8]), zp=st.booleans())
def test_kernel_matches_reference(M, D, dtype, qdtype, zp):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = case(M, D, dtype, qdtype, zp and qdtype == torch.int8, seed=M * D, device=device)
    y, q = kernel(*args, True, INTERPRETED)
    ry, rq = _reference(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], True)
    check(y, q, ry, rq, dtype, qdtype)


def test_op_without_float_output_and_leading_dims():
    x, w, b, eps, inv, z, qd = case(6, 32, torch.float32, torch.int8, True)
    y, q = torch.ops.qfuse.layer_norm_quant(x.reshape(2, 3, 32), w, b, eps, inv, z, qd, False)
    assert y.numel() == 0 and q.shape == (2, 3, 32) and q.dtype == torch.int8


@pytest.mark.parametrize("write_y", [True, False])
def test_opcheck(write_y):
    args = case(4, 16, torch.float32, torch.int8, True)
    torch.library.opcheck(torch.ops.qfuse.layer_norm_quant.default, (*args, write_y),
                          test_utils=("test_schema", "test_faketensor"))


@settings(max_examples=10, deadline=None)
@given(M=st.integers(1, 9), D=st.sampled_from([8, 48, 100]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       qdtype=st.sampled_from([torch.int8, FP8]))
def test_rms_kernel_matches_reference(M, D, dtype, qdtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, _, _, inv, _, qd = case(M, D, dtype, qdtype, False, seed=M + D, device=device)
    w = w.to(dtype)  # transformers' RMSNorm weight has the activations' dtype
    y, q = kernel(x, w, None, 1e-6, inv, None, qd, True, INTERPRETED, rms=True)
    ry, rq = _reference(x.cpu(), w.cpu(), None, 1e-6, inv.cpu(), None, qd, True, rms=True)
    check(y, q, ry, rq, dtype, qdtype)
