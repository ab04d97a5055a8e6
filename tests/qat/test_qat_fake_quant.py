"""Fake quant: forward values on convert's grid (exact), STE and LSQ gradients."""

import pytest
import torch

from qfuse.flows.qat.fake_quant import (
    FP8_FROM_INT8,
    Grid,
    fake_quantize_activation,
    fake_quantize_per_token,
    fake_quantize_weight,
    lsq_factor,
    weight_scale_like_convert,
)
from qfuse.ops.reference import quantize_per_token
from qfuse.primitives import (
    dequantize,
    fake_quantize,
    quantize_weight,
    quantize_weight_fp8,
)

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("zp", [0, -7, 30])
def test_activation_forward_is_primitives_fake_quantize(zp):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 83, generator=g) * 4
    scale, zero_point = torch.tensor(0.0137), torch.tensor(zp, dtype=torch.int32)
    out = fake_quantize_activation(x, scale, zero_point, torch.int8)
    assert torch.equal(out, fake_quantize(x, scale, zero_point))


def test_fp8_activation_forward_uses_converts_rescaled_scale():
    x = torch.randn(5, 33) * 10
    scale = torch.tensor(0.05)
    out = fake_quantize_activation(x, scale, torch.tensor(0, dtype=torch.int32), FP8)
    s8 = scale * FP8_FROM_INT8
    ref = torch.clamp(x * torch.reciprocal(s8), -448, 448).to(FP8).float() * s8
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_forward_is_what_convert_stores(dtype, per_channel):
    w = torch.randn(9, 3, 3, 3)
    quant = quantize_weight_fp8 if dtype == FP8 else quantize_weight
    q, scale = quant(w, per_channel)
    fq = fake_quantize_weight(
        w, weight_scale_like_convert(w, dtype, per_channel), dtype, per_channel
    )
    assert torch.equal(fq, dequantize(q.float(), scale, axis=0))


def test_per_token_forward_and_identity_gradient():
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = fake_quantize_per_token(x, torch.int8)
    q, scale = quantize_per_token(x.detach().reshape(-1, 16), torch.int8)
    assert torch.equal(out.reshape(-1, 16), dequantize(q, scale, axis=0))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_ste_passes_gradient_inside_the_grid_only():
    scale, zp = torch.tensor(0.1), torch.tensor(0, dtype=torch.int32)
    x = torch.tensor([-20.0, -12.0, 0.03, 5.0, 12.7, 13.0], requires_grad=True)
    fake_quantize_activation(x, scale, zp, torch.int8).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # grid: [-12.8, 12.7]


def test_ste_with_smoothing_scales_the_gradient_by_one_over_s():
    x = torch.randn(4, 6, requires_grad=True)
    s = torch.tensor([1.0, 2.0, 4.0, 0.5, 1.0, 8.0])
    fake_quantize_activation(
        x, torch.tensor(0.5), torch.tensor(0, dtype=torch.int32), torch.int8, s
    ).sum().backward()
    assert torch.allclose(x.grad, (1 / s).expand(4, 6))


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_lsq_activation_scale_gradient(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 50) * 3
    scale = torch.tensor(0.02, requires_grad=True)
    zp = 5 if dtype == torch.int8 else 0
    y = fake_quantize_activation(x, scale, torch.tensor(zp, dtype=torch.int32), dtype)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    # LSQ: d out / d s = Q(v) - v inside the grid, the clip bound outside (v = x / s)
    mult = FP8_FROM_INT8 if dtype == FP8 else 1.0
    s = 0.02 * torch.tensor(mult)
    v = x * torch.reciprocal(s)
    if dtype == FP8:
        q, inside, grid = torch.clamp(v, -448, 448).to(FP8).float(), v.abs() <= 448, "act_fp8"
    else:
        q = torch.clamp(torch.round(v) + zp, -128, 127) - zp
        inside, grid = (v + zp >= -128) & (v + zp <= 127), "act_int8"
    assert 0.2 < inside.float().mean() < 1.0  # both branches exercised
    ref = (g * (q - v * inside)).sum() * lsq_factor(50, Grid(grid)) * mult
    torch.testing.assert_close(scale.grad, ref, rtol=1e-5, atol=0)


def test_lsq_weight_scale_gradient_per_channel():
    torch.manual_seed(0)
    w = torch.randn(6, 10)
    scale = torch.full((6,), 0.01, requires_grad=True)
    y = fake_quantize_weight(w, scale, torch.int8, per_channel=True)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    v = w / 0.01
    q = torch.clamp(torch.round(v), -127, 127)
    inside = v.abs() <= 127
    ref = (g * (q - v * inside)).sum(1) * lsq_factor(10, Grid("weight_int8"))
    torch.testing.assert_close(scale.grad, ref, rtol=1e-4, atol=1e-6)
