"""``qfuse.testing``: the fp8 tolerance still rejects a wrong output (CPU, no kernel launch).

The reference output stands in for a kernel's; perturbing it by what a wrong kernel produces must
fail the bound under both accumulation modes, and an error within the mode's bound must pass.
"""

from __future__ import annotations

import pytest
import torch

from qfuse.ops import reference
from qfuse.testing import (
    FP8,
    Accumulation,
    accumulation_eps,
    conv_magnitude,
    output_excess,
)
from tests.kernels.test_conv import make_case, split


def _case():
    args = make_case("cpu", qdtype=FP8, out_dtype=FP8, act="relu", c_in=16, c_out=16, hw=(8, 8))
    ref = reference.qconv2d(*split(args))
    xq = reference._quantize_input(args["x"], args["x_inv_scale"], None, FP8)
    mag = conv_magnitude(xq, args["weight"], args["stride"], args["padding"], args["dilation"],
                         1) * args["scale"].double().reshape(1, -1, 1, 1)
    return args, ref, mag


def _bump(ref: torch.Tensor, where: torch.Tensor, codes: int) -> torch.Tensor:
    """``ref`` with the e4m3 codes at ``where`` moved up by ``codes`` (positives only)."""
    bits = ref.view(torch.uint8).clone()
    bits[where] += codes
    return bits.view(FP8)


@pytest.mark.parametrize("mode", list(Accumulation))
def test_a_five_code_error_away_from_zero_fails(mode):
    """One e4m3 step at max(|a|, |b|) / 8 admits two codes just below a power of two, and the
    tensor-core bound (2**-10 of the magnitude sum, as measured on the H100) up to two more at
    y >= 0.5: five codes away from zero must fail in every mode."""
    args, ref, mag = _case()
    eps = accumulation_eps(mode, 16 * 9)
    inv = args["out_inv_scale"].item()
    assert output_excess(ref, ref, eps * mag, inv).max() == 0
    big = (ref.double() >= 50) & (ref.double() <= 300)  # below 448: no NaN code
    assert big.sum() > 10
    bad = _bump(ref, big, 5)
    assert (output_excess(bad, ref, eps * mag, inv)[big] > 1).all()


def test_the_tensor_core_bound_admits_a_near_zero_error_fp32_does_not():
    """H100's failure mode: a few 1e-3 of y where the reference is 0 (ReLU). It is inside the
    tensor-core bound (2**-10 of a magnitude sum of ~100) and outside float32's (K * 2**-24)."""
    args, ref, mag = _case()
    inv = args["out_inv_scale"].item()
    zero = ref.double() == 0
    y_err = 0.5 * 2.0**-13 * mag  # half the tensor core's bound, in y
    off = (y_err * inv).clamp(max=448).to(FP8)  # a kernel that read y = +y_err there
    out = torch.where(zero, off, ref)
    tc = output_excess(out, ref, accumulation_eps(Accumulation.FP8_TENSOR_CORE, 144) * mag, inv)
    fp32 = output_excess(out, ref, accumulation_eps(Accumulation.FP32, 144) * mag, inv)
    assert (tc <= 1).all()
    assert (fp32 > 1).any()


def test_a_wrong_reduction_fails_in_either_mode():
    """A kernel that drops one input channel (a masking bug) misses the bound."""
    args, ref, mag = _case()
    wrong = dict(args, weight=args["weight"].clone())
    wrong["weight"][:, 3] = 0
    bad = reference.qconv2d(*split(wrong))
    inv = args["out_inv_scale"].item()
    for mode in Accumulation:
        assert (output_excess(bad, ref, accumulation_eps(mode, 144) * mag, inv) > 1).sum() > 50
