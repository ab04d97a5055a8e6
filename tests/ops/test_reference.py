"""``qfuse.ops.reference``: the quantization semantics every kernel is checked against."""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.gemm.call import GemmCall
from qfuse.ops import reference

FP8 = torch.float8_e4m3fn


def test_fp8_quantize_saturates_and_rounds_to_nearest_even():
    one = torch.tensor(1.0)
    x = torch.tensor([1e6, -1e6, 448.0, 464.0, 1.0625, 1.1875, -0.0, 2.0**-10])
    q = reference.quantize_fp8(x, one)
    # 464 sits halfway between 448 and the (absent) 480: saturates; 1.0625 ties to 1.0 (even),
    # 1.1875 ties to 1.25 (even); -0.0 keeps its sign; 2**-10 is half the smallest subnormal.
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0, 1.0, 1.25, -0.0, 0.0]
    assert q[6].view(torch.uint8).item() == 0x80


def test_fp8_quantize_matches_torch_cast_inside_the_range():
    x = torch.randn(10000) * torch.logspace(-4, 2, 10000)
    torch.testing.assert_close(reference.quantize_fp8(x, torch.tensor(1.0)).float(),
                               x.to(FP8).float(), rtol=0, atol=0)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
def test_per_token_scales(qdtype):
    x = torch.randn(5, 33) * torch.tensor([0.0, 1e-3, 1.0, 10.0, 1e4])[:, None]
    q, scale = reference.quantize_per_token(x, qdtype)
    qmax = 127.5 if qdtype == torch.int8 else 448.0
    amax = x.abs().amax(dim=1)
    expect = torch.clamp(amax / qmax, min=torch.finfo(torch.float32).eps)
    assert torch.equal(scale, expect)
    assert torch.equal(q[0].float(), torch.zeros(33))  # an all-zero row stays zero
    err = (q.float() * scale[:, None] - x).abs().amax(dim=1)
    bound = scale * (0.5 if qdtype == torch.int8 else 16.0)  # half a step / e4m3's top spacing
    assert (err <= bound * 1.001 + 1e-12).all()  # amax itself lands on 127.5 -> 127


def test_fp8_matmul_is_the_exact_sum_rounded_once():
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(7, 300, generator=g) * 50).to(FP8)
    b = (torch.randn(9, 300, generator=g) * 50).to(FP8)
    exact = (a.double()[:, None, :] * b.double()[None, :, :]).sum(-1)
    assert torch.equal(reference.fp8_matmul(a, b), exact.float())


def test_int_matmul_is_exact_beyond_float32():
    # K * 127 * 128 > 2**24, where a float32 sum would round: the reference switches to float64.
    a = torch.full((2, 4096), 127, dtype=torch.int8)
    b = torch.full((3, 4096), -128, dtype=torch.int8)
    assert torch.equal(reference.int_matmul(a, b), torch.full((2, 3), -127 * 128 * 4096,
                                                              dtype=torch.int32))


def test_row_scale_follows_the_channel_scale():
    acc = torch.tensor([[3, -5], [7, 11]], dtype=torch.int32)
    scale, rows = torch.tensor([0.1, 0.3]), torch.tensor([2.0, 0.7])
    call = GemmCall(torch.zeros(2, 1, dtype=torch.int8), scale)
    out = reference.epilogue(acc, call, row_scale=rows)
    assert torch.equal(out, acc.float() * scale[None, :] * rows[:, None])


def test_fp8_output_requantizes_with_saturation():
    acc = torch.tensor([[1000, -1000, 3]], dtype=torch.int32)
    call = GemmCall(torch.zeros(3, 1, dtype=FP8), torch.ones(3), out_inv_scale=torch.tensor(1.0),
                    out_dtype=FP8)
    out = reference.epilogue(acc, call)
    assert out.dtype == FP8 and out.float().tolist() == [[448.0, -448.0, 3.0]]
