"""``qfuse.kernels.quantize`` against ``qfuse.ops.reference``: identical codes and scales."""

from __future__ import annotations

import pytest
import torch

from qfuse.kernels.quantize import quantize
from qfuse.ops import reference

FP8 = torch.float8_e4m3fn


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def rows(M, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M)[:, None]
    x[0] = 0.0  # an all-zero row: scale falls back to eps, codes are all 0
    x[1, 5] = 1e6  # one outlier dominates its row
    x[2, 3] = -0.0  # keeps its sign through quantization, as torch's cast does
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("K", [7, 1500])  # one partial block; two blocks with a ragged tail
def test_dynamic_per_token(device, qdtype, K):
    x = rows(9, K, device)
    q, scale = quantize(x, qdtype, None, None, exact=device.type == "cpu")
    ref_q, ref_scale = reference.quantize_per_token(x.cpu(), qdtype)
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(as_bits(q.cpu()), as_bits(ref_q))
    assert scale[0].item() == torch.finfo(torch.float32).eps


@pytest.mark.parametrize("qdtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_static(device, qdtype, per_channel):
    K = 45
    x = rows(6, K, device, seed=1)
    inv = torch.rand(K) * 50 + 1 if per_channel else torch.tensor(37.0)
    zp = torch.tensor(-5, dtype=torch.int32) if qdtype == torch.int8 else None
    q, scale = quantize(x, qdtype, inv.to(device), zp.to(device) if zp is not None else None,
                        exact=device.type == "cpu")
    assert scale is None
    ref = reference._quantize_input(x.cpu(), inv, zp, qdtype)
    assert torch.equal(as_bits(q.cpu()), as_bits(ref))
    assert q.view(torch.uint8).unique().numel() > 30  # saturation and rounding both exercised


def test_empty(device):
    q, scale = quantize(torch.empty(0, 8, device=device), torch.int8, None, None, exact=False)
    assert q.shape == (0, 8) and scale.shape == (0,)


@pytest.mark.parametrize("zp", [None, -5, 7])
def test_int8_ties_and_saturation(device, zp):
    """Exact halves round to even, far and infinite values saturate, with and without a zero
    point: the compiled path rounds and saturates in ``cvt.rni.sat.s8`` (after rounding, then
    adding the zero point), the interpreter by clamps and a rounding constant; both must give
    the reference's codes."""
    halves = torch.arange(-140, 140, dtype=torch.float32) + 0.5
    far = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), 3e9, -3e9, 255.5, -256.5])
    x = torch.cat([halves, -halves, far, torch.zeros(4)]).to(torch.bfloat16)[None, :]
    inv = torch.tensor(1.0)
    zpt = torch.tensor(zp, dtype=torch.int32) if zp is not None else None
    q, _ = quantize(x.to(device), torch.int8, inv.to(device),
                    zpt.to(device) if zpt is not None else None, exact=device.type == "cpu")
    ref = reference._quantize_input(x, inv, zpt, torch.int8)
    assert torch.equal(q.cpu(), ref)
    assert {-128, 127} <= set(ref.unique().tolist())
