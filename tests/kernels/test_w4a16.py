"""The W4A16 GEMM (``kernels/gemm/w4a16.py``) against the CPU reference (``ops.w4linear``) under
the Triton interpreter: float32 x within float32 sum-order rounding, bf16 x within bf16's
rounding of the dequantized weight. Shapes are awkward on purpose: M of 1 and 7 (partial row
blocks), N = 21 (a partial column block), K not a multiple of 8 (a padded last word), of the
block (a masked K tail) or of the group (a short last group), per-channel groups, zero points."""

from __future__ import annotations

import pytest
import torch

from qfuse import int4
from qfuse.kernels.common import INTERPRETED
from qfuse.kernels.gemm.w4a16 import w4a16_gemm
from qfuse.ops.backend import use_backend
from qfuse.ops.w4linear import W4Call, gemm_reference, w4linear

pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")

CASES = [  # (M, N, K, group)
    (1, 21, 83, None),  # per channel, K % 8 = 3
    (7, 21, 96, 32),  # aligned groups (one scale vector per K step)
    (5, 16, 200, 64),  # last group 8 columns, K tail inside it
    (3, 9, 40, 8),  # groups shorter than the K step
]


def _layer(N, K, group, symmetric, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    scale, zero = int4.group_qparams(w, group, symmetric)
    q = int4.quantize_groups(w, scale, zero, group)
    return W4Call(int4.pack(q).to(device), scale.to(device),
                  zero.to(device) if zero is not None else None, None, K, group)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("M,N,K,group", CASES)
def test_w4a16_fp32_matches_reference(device, M, N, K, group, symmetric):
    call = _layer(N, K, group, symmetric, device)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(device)
    got = w4a16_gemm(x, call.weight, call.scale, call.zero, K, group)
    want = gemm_reference(x.cpu(), W4Call(call.weight.cpu(), call.scale.cpu(),
                                          call.zero.cpu() if call.zero is not None else None,
                                          None, K, group))
    # float32 sums in another order: a few ulps of the row's magnitude
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("M,N,K,group", CASES[1:3])
def test_w4a16_bf16_input(device, M, N, K, group):
    """bf16 x: on a GPU the dequantized weight is rounded to bf16 for the MMA; the interpreter
    (whose bf16 casts truncate) multiplies the float32 weight, as the reference does."""
    call = _layer(N, K, group, False, device, seed=2)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    got = w4a16_gemm(x, call.weight, call.scale, call.zero, K, group)
    w = int4.dequantize_groups(int4.unpack(call.weight.cpu(), K), call.scale.cpu(),
                               call.zero.cpu(), group)
    if x.is_cuda:
        w = w.to(torch.bfloat16)
    want = x.cpu().double() @ w.double().t()
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


def test_module_path_through_triton_backend(device):
    """``w4linear`` with the triton backend: the kernel plus the torch epilogue (gated SwiGLU,
    bias, residual) equals the reference path."""
    call = _layer(10, 40, 8, True, device, seed=4)
    call = W4Call(call.weight, call.scale, call.zero, torch.randn(10).to(device), 40, 8,
                  act="swiglu")
    x = torch.randn(2, 3, 40).to(device)
    res = torch.randn(2, 3, 5).to(device)
    with use_backend("reference"):
        want = w4linear(x, call, res)
    with use_backend("triton"):
        got = w4linear(x, call, res)
    assert got.shape == (2, 3, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
