import pytest
import torch

from qfuse.primitives import (
    INT8_MAX,
    INT8_MIN,
    SCALE_EPS,
    WEIGHT_INT8_MAX,
    WEIGHT_INT8_MIN,
    choose_qparams,
    dequantize,
    divide,
    fake_quantize,
    quantize,
    quantize_weight,
    weight_scale,
)


def test_symmetric_activation_range_uses_full_int8():
    lo, hi = torch.tensor(-2.0), torch.tensor(1.0)
    scale, zp = choose_qparams(lo, hi, symmetric=True)
    assert scale.item() == torch.tensor(2.0 / 127.5, dtype=torch.float32).item()
    assert zp.item() == 0
    # +-amax land on +-127.5 up to the float32 rounding of the scale: +amax clamps to 127, -amax
    # rounds to -127 or -128; anything beyond the range clamps to the int8 edges.
    q = quantize(torch.tensor([-2.0, 2.0, 0.0, -5.0, 5.0]), scale, zp)
    assert q[0].item() in (-127, INT8_MIN)
    assert q[1:].tolist() == [INT8_MAX, 0, INT8_MIN, INT8_MAX]


def test_weights_use_narrow_symmetric_range():
    w = torch.tensor([[-3.0, 1.0, 3.0], [0.5, -0.25, 0.0]])
    q, scale = quantize_weight(w, per_channel=True)
    assert q.dtype == torch.int8
    assert scale.tolist() == pytest.approx([3.0 / 127, 0.5 / 127], rel=1e-7)
    assert q.min() >= WEIGHT_INT8_MIN and q.max() <= WEIGHT_INT8_MAX
    assert q[0].tolist() == [-127, 42, 127]
    assert q[1].tolist() == [127, -64, 0]


def test_per_tensor_weight_scale_is_broadcast_per_channel():
    w = torch.randn(5, 7)
    q, scale = quantize_weight(w, per_channel=False)
    assert scale.shape == (5,) and torch.all(scale == scale[0])
    assert scale[0].item() == pytest.approx(w.abs().max().item() / 127, rel=1e-6)


def test_round_half_to_even():
    scale = torch.tensor(1.0)
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5])
    assert quantize(x, scale).tolist() == [0, 2, 2, 0, -2, -2]


def test_affine_qparams_match_torch_ao_definition():
    lo, hi = torch.tensor(-0.5), torch.tensor(3.0)
    scale, zp = choose_qparams(lo, hi, symmetric=False)
    assert scale.item() == pytest.approx(3.5 / 255, rel=1e-7)
    assert zp.item() == INT8_MIN - round(-0.5 / scale.item())
    q = quantize(torch.tensor([-0.5, 0.0, 3.0]), scale, zp)
    assert q.tolist() == [INT8_MIN, zp.item(), INT8_MAX]
    assert dequantize(q, scale, zp)[1].item() == 0.0  # zero is exactly representable


def test_range_always_includes_zero_and_scale_is_clamped():
    scale, zp = choose_qparams(torch.tensor(2.0), torch.tensor(3.0), symmetric=False)
    assert zp.item() == INT8_MIN  # min clamped to 0
    scale0, _ = choose_qparams(torch.tensor(0.0), torch.tensor(0.0), symmetric=True)
    assert scale0.item() == pytest.approx(SCALE_EPS)


@pytest.mark.parametrize("seed", range(20))
def test_fake_quantize_error_is_bounded_by_half_a_step(seed):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
    scale, zp = choose_qparams(x.min(), x.max(), symmetric=True)
    err = (fake_quantize(x, scale, zp) - x).abs().max().item()
    # Half a step, plus the float32 rounding of the scale itself, which the edge value
    # -128 * scale magnifies 128-fold (seen: 1.2e-5 relative over half a step).
    s = scale.item()
    assert err <= s / 2 + 128 * s * 2**-22


def test_divide_is_correctly_rounded(device):
    x = torch.rand(4096, device=device) * torch.logspace(-6, 6, 4096, device=device)
    for constant in (127.5, 127.0, 448.0, 255.0):
        exact = (x.double() / constant).float()  # float64 then round: the correctly rounded
        assert torch.equal(divide(x, constant), exact)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_scales_are_the_same_on_cpu_and_cuda(dtype):
    w = torch.randn(257, 300) * torch.rand(257, 1) * 3
    lo, hi = w.amin(1), w.amax(1)
    for symmetric in (True, False):
        cpu = choose_qparams(lo, hi, symmetric=symmetric)
        gpu = choose_qparams(lo.cuda(), hi.cuda(), symmetric=symmetric)
        assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True))
    assert torch.equal(weight_scale(w, dtype, True), weight_scale(w.cuda(), dtype, True).cpu())
