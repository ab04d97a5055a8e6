"""Gated activations (SwiGLU / GeGLU) in the GEMM epilogue: weight rows interleave gate and up
projections, the kernel writes ``act(gate) * up`` (N / 2 columns). Kernel vs reference, as in
test_qgemm: int8 GEMMs bit-exact, fp8 within its accumulation's rounding."""

from __future__ import annotations

import pytest
import torch
from test_qgemm import FP8, check, make_case, reference_out

from qfuse.kernels.schedules import GemmConfig
from qfuse.ops import reference

GATED = ("swiglu", "geglu", "geglu_tanh")


def gated_case(M, K, N, device, act, *, residual=False, **kw):
    args = make_case(M, K, N, device, act=act, **kw)
    if residual:
        g = torch.Generator().manual_seed(5)
        args["residual"] = torch.randn(M, N // 2, generator=g).to(torch.bfloat16).to(device)
    return args


@pytest.mark.parametrize("act", GATED)
@pytest.mark.parametrize("out_dtype", [torch.int8, FP8, torch.float32, torch.bfloat16], ids=str)
def test_gated_epilogue(device, act, out_dtype):
    args = gated_case(19, 70, 38, device, act, out_dtype=out_dtype, residual=True)
    out = check(args)
    assert out.shape == (19, 19)
    if out_dtype in (torch.int8, FP8):
        assert out.view(torch.uint8).unique().numel() > 20


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("x_mode", ["static", "dynamic", "quantized"])
def test_gated_inputs(device, qdtype, x_mode):
    check(gated_case(5, 33, 22, device, "swiglu", qdtype=qdtype, x_mode=x_mode,
                     out_dtype=torch.int8 if qdtype == torch.int8 else torch.float32,
                     zp=qdtype == torch.int8 and x_mode == "static"))


@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 32, split_k=3, num_stages=2),
                                 GemmConfig(32, 64, 32, epi_split=2, num_stages=2)],
                         ids=["split3", "epi2"])
def test_gated_schedules(device, cfg):
    # M=1 (decode), N = 2 x 35: the last column tile holds a partial set of pairs.
    for M in (1, 37):
        check(gated_case(M, 150, 70, device, "swiglu", out_dtype=torch.int8, residual=True), cfg)


def test_reference_is_act_gate_times_up():
    """The reference on interleaved rows equals act(x Wg^T) * (x Wu^T) on separate weights."""
    args = gated_case(4, 16, 12, "cpu", "swiglu", out_dtype=torch.float32, bias=True)
    out = reference_out(args)
    plain = reference_out(args | {"act": "none"})
    gate, up = plain[:, 0::2], plain[:, 1::2]
    torch.testing.assert_close(out, reference.silu(gate) * up, rtol=0, atol=0)
