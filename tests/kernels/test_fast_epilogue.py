"""The fast GELU/SiLU epilogue (hardware erf/exp) against the exact one and the reference.

Contract (``kernels.common.activation``): with ``fast_act`` the activation's float result differs
from the IEEE-exact polynomials by float32 rounding only (relative 2e-6 of the output scale here),
so int8 outputs are within one step of the reference's, and rarely off at all (< 1% of values,
where the exact value sits on a rounding boundary); float outputs agree to 1e-5 relative. ReLU and
identity epilogues are untouched (bit-exact). Runs under the interpreter on CPU and on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_qgemm import make_case, reference_out, run

HEAVY = ("gelu", "gelu_tanh", "silu")


@pytest.mark.parametrize("act", HEAVY)
@pytest.mark.parametrize("M", [1, 37, 96])
def test_int8_outputs_within_one_step(act, M, device):
    args = make_case(M, 64, 80, device, act=act, out_dtype=torch.int8, seed=M)
    fast = run(args | {"fast_act": True}).cpu()
    ref = reference_out(args)
    diff = (fast.int() - ref.int()).abs()
    assert diff.max() <= 1
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("act", HEAVY)
def test_float_outputs_close(act, device):
    args = make_case(33, 64, 48, device, act=act, out_dtype=torch.float32, residual=True)
    fast = run(args | {"fast_act": True}).cpu()
    torch.testing.assert_close(fast, reference_out(args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["none", "relu"])
def test_light_epilogues_stay_exact(act, device):
    args = make_case(17, 64, 48, device, act=act, out_dtype=torch.int8)
    assert torch.equal(run(args | {"fast_act": True}).cpu(), reference_out(args))


def test_exact_epilogue_is_the_module_default_off_gpu_and_an_option_on_it():
    from qfuse.nn import QLinear

    lin = QLinear.from_float(torch.randn(8, 16), None, x_scale=torch.tensor(0.05),
                             x_zero_point=None, activation="gelu")
    assert lin.exact_epilogue is False  # GPU default: fast; CPU always runs the exact reference
    lin.exact_epilogue = True
    assert lin.layout()["exact_epilogue"] is True
