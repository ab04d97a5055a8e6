"""Tolerances for fp8 kernels against the exact reference, derived from how the kernel sums.

An fp8 kernel's output differs from ``ops.reference`` (exact float64 sums) by its accumulation
error, carried through the epilogue, plus one rounding to the output dtype. The accumulation
error is bounded by ``eps * sum_k |x_q[k] * w_q[k]|`` (the *magnitude sum*, which the reference
computes as the same GEMM/conv over ``|x_q|``, ``|w_q|``), with ``eps`` from how the products
are summed (``Accumulation``):

- ``FP32``: float32 adds of exact e4m3 products (the interpreter; a GPU whose fp8 dot promotes,
  ``ConvConfig.fp8_promote`` > 0). Recursive summation's worst case: ``K * 2**-24``.
- ``FP8_TENSOR_CORE``: Hopper wgmma accumulating in place (Triton's sm_90 default,
  ``max_num_imprecise_acc = 2**30``): about 14 retained bits (DeepSeek-V3 report, sec. 3.3.2),
  nominally ``2**-13``, but measured on an H100 (torch 2.11 / triton 3.6: the worst error over
  the magnitude sum, float32 outputs) it reached 2**-10.9 (r50 3x3 128ch) and 2**-11.2 to
  2**-12.1 on the other seven conv shapes, so that with 2**-13 the GPU tests' float32 checks
  failed. The bound is ``2**-10``: 1.9x the worst measured.
  With promotion the tensor core still sums each interval at its own precision, but relative
  to that interval's partial instead of the whole running sum; it is treated as ``FP32`` here,
  which bench's fp8 conv diagnostic checks on the GPU.

A wrong kernel still fails: away from zero the bound is one output step plus a few 1e-3 of y.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from qfuse.kernels.common import EPILOGUE_ACTIVATIONS

FP8 = torch.float8_e4m3fn


class Accumulation(enum.Enum):
    """How a kernel sums its products (see the module docstring for the numbers)."""

    EXACT = "exact"  # int32, or float64 (the reference)
    FP32 = "fp32"
    FP8_TENSOR_CORE = "fp8_tensor_core"


# Largest slope of each activation (Lipschitz constant): an input error d moves the output by at
# most slope * d (kernels.common.EPILOGUE_ACTIVATIONS).
ACT_SLOPE = {name: a.slope for name, a in EPILOGUE_ACTIVATIONS.items() if not a.gate}

# One rounding of a float output, relative to its magnitude (one ulp), and the absolute floor
# for float32 epilogue arithmetic (its ~40 IEEE ops in GELU/SiLU, each 2**-24 relative).
_FLOAT_ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def accumulation_eps(mode: Accumulation, reduction: int) -> float:
    """Bound on the accumulation error as a fraction of the magnitude sum."""
    if mode is Accumulation.EXACT:
        return 0.0
    if mode is Accumulation.FP32:
        return reduction * 2.0**-24
    return 2.0**-10  # measured worst 2**-10.9 (see the module docstring)


def fp8_accumulation(device: torch.device | str, fp8_promote: int = 0) -> Accumulation:
    """What an fp8 ``tl.dot`` does on ``device``: in place at the tensor core's precision on
    sm_90 with Triton's default (``fp8_promote`` 0), float32 sums otherwise (the interpreter,
    or a promotion interval; sm_89/sm_100 dots default to float32 accumulation)."""
    device = torch.device(device)
    if device.type == "cuda" and fp8_promote == 0:
        if torch.cuda.get_device_capability(device) == (9, 0):
            return Accumulation.FP8_TENSOR_CORE
    return Accumulation.FP32


def linear_magnitude(xq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_k |x_q[m, k] * w_q[n, k]|`` [M, N], exact in float64."""
    return xq.double().abs() @ w.double().abs().t()


def conv_magnitude(xq: torch.Tensor, w: torch.Tensor, stride, padding, dilation,
                   groups: int) -> torch.Tensor:
    """The conv's magnitude sum per output [N, O, OH, OW], exact in float64 (padding adds 0)."""
    return F.conv2d(xq.double().abs(), w.double().abs(), None, stride, padding, dilation, groups)


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at |x| (3 mantissa bits; subnormal spacing 2**-9)."""
    return x.abs() / 8 + 2.0**-9


def output_excess(out: torch.Tensor, ref: torch.Tensor, y_error: torch.Tensor,
                  out_inv_scale: float | None = None) -> torch.Tensor:
    """``|out - ref|`` over what is allowed, elementwise (> 1: outside the bound).

    ``y_error`` bounds the difference of the float results before the output rounding (the
    accumulation bound times ``|scale|`` and the activations' slopes). An fp8 output
    (``out_inv_scale`` its static inverse scale) may differ by that, in output units, plus one
    e4m3 step at the larger of the two (each side rounds once); a float output by that plus one
    ulp of its dtype."""
    a, b = out.double(), ref.double()
    big = torch.maximum(a.abs(), b.abs())
    if out.dtype == FP8:
        allowed = e4m3_step(big) + y_error * out_inv_scale
    else:
        allowed = y_error + big * _FLOAT_ULP[out.dtype] + 2.0**-20
    return (a - b).abs() / allowed


def describe_excess(out: torch.Tensor, ref: torch.Tensor, excess: torch.Tensor) -> str:
    """How many values miss, and the worst, for an assertion message."""
    worst = excess.argmax()
    return (f"{int((excess > 1).sum())} of {excess.numel()} outside; worst "
            f"{out.double().flatten()[worst].item()} vs {ref.double().flatten()[worst].item()} "
            f"({excess.flatten()[worst].item():.2f}x the bound)")
