"""Pure-PyTorch implementation of every fused op: the CPU path and the test oracle.

Each function mirrors its Triton twin in ``qfuse/kernels`` operation by operation (see
``qfuse/kernels/common.py`` for why the math avoids ``torch.exp``/``torch.erf``): int32
accumulation, then the float32 epilogue in the same order with the same rounding, so an int8 output
is identical on CPU and GPU and a float output agrees to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.kernels.common import GATED_ACTIVATIONS
from qfuse.kernels.conv.call import ConvCall
from qfuse.kernels.gemm.call import GemmCall
from qfuse.primitives import FP8_E4M3_MAX, SCALE_EPS, divide

FP8 = torch.float8_e4m3fn


def quantize_int8(x: torch.Tensor, inv_scale: torch.Tensor, zero_point) -> torch.Tensor:
    """float32 -> int8: clamp(round(x * inv_scale) + zero_point, -128, 127)."""
    v = torch.clamp(x * inv_scale, -256.0, 256.0)
    v = torch.round(v) + zero_point
    return torch.clamp(v, -128.0, 127.0).to(torch.int8)


def quantize_fp8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """float32 -> float8 e4m3fn: clamp(x * inv_scale, -448, 448), round to nearest even.

    The clamp saturates (torch's own cast turns overflow into NaN); kernels do the same.
    """
    return torch.clamp(x * inv_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)


def quantize_per_token(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row quantization: ``(q, scale[M])``, twin of ``kernels.quantize``.

    ``scale = max(amax / qmax, eps)`` with qmax 127.5 for int8 (the symmetric activation
    convention of ``primitives.choose_qparams``) and 448 for fp8; ``q = quantize(x * (1/scale))``.
    """
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=1)
    # A true division on every device (see primitives.divide): the kernel's div_rn is one too.
    scale = torch.clamp(divide(amax, FP8_E4M3_MAX if qdtype == FP8 else 127.5),
                        min=SCALE_EPS)
    inv = torch.reciprocal(scale)[:, None]
    q = quantize_fp8(x, inv) if qdtype == FP8 else quantize_int8(x, inv, 0.0)
    return q, scale


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.common.exp_f32``."""
    x = torch.clamp(x, -87.0, 88.0)
    n = torch.round(x * 1.4426950408889634)
    r = x - n * 0.693359375
    r = r + n * 2.12194440e-4
    p = torch.full_like(r, 1.9841269841269841e-4)
    for c in (
        1.3888888888888889e-3,
        8.3333333333333333e-3,
        4.1666666666666667e-2,
        1.6666666666666667e-1,
        0.5,
        1.0,
        1.0,
    ):
        p = p * r + c
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return p * two_n


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.common.gelu_erf``."""
    z = x * 0.7071067811865476
    az = torch.abs(z)
    t = (az * 0.0 + 1.0) / (1.0 + 0.3275911 * az)
    poly = torch.full_like(t, 1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly = poly * t + c
    erfc = poly * t * exp_f32(-(az * az))
    one_plus_erf = torch.where(z < 0.0, erfc, 2.0 - erfc)
    return 0.5 * x * one_plus_erf


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.common.gelu_tanh``."""
    u = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
    return x / (1.0 + exp_f32(-2.0 * u))


def silu(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.common.silu``."""
    return x / (1.0 + exp_f32(-x))


def hardswish(x: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.common.hardswish``: x * clamp(x + 3, 0, 6) / 6 (a true division)."""
    y = x * torch.clamp(x + 3.0, 0.0, 6.0)
    return y / torch.full_like(y, 6.0)


ACTIVATIONS = {
    "none": lambda x: x,
    "relu": lambda x: torch.clamp_min(x, 0.0),
    "gelu": gelu_erf,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "hardswish": hardswish,
}


def _exact_float_dtype(reduction: int, max_a: int, max_b: int) -> torch.dtype:
    """float32 holds every partial sum of integers exactly while |sum| < 2**24 (any summation
    order, so any BLAS); beyond that float64 (exact below 2**53)."""
    return torch.float32 if reduction * max_a * max_b < 2**24 else torch.float64


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [N, K]^T -> int32, exactly (equal to the GPU's int32 accumulation)."""
    dtype = _exact_float_dtype(a.shape[-1], 128, 128)
    return torch.matmul(a.to(dtype), b.to(dtype).t()).to(torch.int32)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp8 [M, K] @ fp8 [N, K]^T -> float32, from the exact float64 sum.

    Each e4m3 product is exact in float64 and so is every partial sum for K < 2**20, so this is
    the correctly rounded result; a GPU's float32 (or tensor-core) accumulation is within its own
    rounding of it, not bit-identical.
    """
    return torch.matmul(a.double(), b.double().t()).to(torch.float32)


def epilogue(
    acc: torch.Tensor,
    call: GemmCall | ConvCall,
    residual: torch.Tensor | None = None,
    channel_dim: int = -1,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Accumulator -> ``call``'s scales, bias, activation, residual, post-activation, then
    int8/fp8 requant or float.

    ``row_scale`` [M] (dynamic per-token activation scales, 2-D ``acc`` only) multiplies after the
    per-channel scale, as the kernel does. ``call.post_act`` is applied after the residual add
    (a ResNet block's ``+ identity -> relu``).
    """
    shape = [1] * acc.dim()
    shape[channel_dim] = -1
    y = acc.to(torch.float32) * call.scale.reshape(shape)
    if row_scale is not None:
        y = y * row_scale[:, None]
    if call.bias is not None:
        y = y + call.bias.reshape(shape)
    if call.act in GATED_ACTIVATIONS:  # interleaved [gate, up] channels -> act(gate) * up
        pair = channel_dim + 1 if channel_dim >= 0 else channel_dim
        gate, up = y.unflatten(channel_dim, (-1, 2)).unbind(pair)
        y = ACTIVATIONS[GATED_ACTIVATIONS[call.act]](gate) * up
    else:
        y = ACTIVATIONS[call.act](y)
    if residual is not None:
        y = y + residual.to(torch.float32)
    y = ACTIVATIONS[call.post_act](y)
    if call.out_dtype == torch.int8:
        zp = call.out_zero_point.to(torch.float32) if call.out_zero_point is not None else 0.0
        return quantize_int8(y, call.out_inv_scale, zp)
    if call.out_dtype == FP8:
        return quantize_fp8(y, call.out_inv_scale)
    return y.to(call.out_dtype)


def _quantize_input(x, x_inv_scale, x_zero_point, qdtype=torch.int8):
    if x.dtype in (torch.int8, FP8):
        return x
    if qdtype == FP8:
        return quantize_fp8(x.to(torch.float32), x_inv_scale)
    zp = x_zero_point.to(torch.float32) if x_zero_point is not None else 0.0
    return quantize_int8(x.to(torch.float32), x_inv_scale, zp)


def qlinear(x: torch.Tensor, call: GemmCall, x_scale: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``kernels.gemm.dispatch.qlinear`` on 2-D x [M, K] (int8 or fp8 weight).

    Float ``x`` without ``call.x_inv_scale`` is quantized per token (dynamic); a quantized ``x``
    may bring its per-token scales in ``x_scale``. An asymmetric ``x`` (``x_zero_point``) is
    corrected by ``- x_zero_point * weight_sum`` on the int32 accumulator when ``weight_sum`` is
    given; without it the caller has folded that correction into ``bias`` (``nn.QLinear`` does).
    """
    weight = call.weight
    if x.is_floating_point() and x.dtype != FP8 and call.x_inv_scale is None:
        x, x_scale = quantize_per_token(x, weight.dtype)
    xq = _quantize_input(x, call.x_inv_scale, call.x_zero_point, weight.dtype)
    acc = fp8_matmul(xq, weight) if weight.dtype == FP8 else int_matmul(xq, weight)
    if call.x_zero_point is not None and call.weight_sum is not None:
        acc = acc - call.x_zero_point.to(torch.int32) * call.weight_sum[None, :]
    return epilogue(acc, call, residual, channel_dim=-1, row_scale=x_scale)


def qconv2d(x: torch.Tensor, call: ConvCall, residual: torch.Tensor | None = None
            ) -> torch.Tensor:
    """int8 conv2d (NCHW) with int32 accumulation and the linear epilogue; fp8 weights give the
    fp8 conv (float64 sums of exact e4m3 products, rounded once to float32, as ``fp8_matmul``).

    The zero point is subtracted before the convolution (exact in float), which is what a
    zero-padded input of real value 0 needs: padding contributes 0, not -zp * w. An int8/fp8
    ``residual`` (handed over by the conv that computed it) is ``(r - residual_zero_point) *
    residual_scale`` in float32 before the add.
    """
    weight = call.weight
    if residual is not None and residual.dtype in (torch.int8, FP8):
        r = residual.to(torch.float32)
        if call.residual_zero_point is not None:
            r = r - call.residual_zero_point.to(torch.float32)
        residual = r * call.residual_scale
    geometry = (call.stride, call.padding, call.dilation, call.groups)
    if weight.dtype == FP8:
        q = _quantize_input(x, call.x_inv_scale, None, FP8).double()
        acc = F.conv2d(q, weight.double(), None, *geometry).float()
    else:
        reduction = weight.shape[1] * weight.shape[2] * weight.shape[3]
        dtype = _exact_float_dtype(reduction, 256, 128)  # q - zp spans up to 255
        q = _quantize_input(x, call.x_inv_scale, call.x_zero_point).to(dtype)
        if call.x_zero_point is not None:
            q = q - call.x_zero_point.to(dtype)
        acc = F.conv2d(q, weight.to(dtype), None, *geometry).to(torch.int32)
    return epilogue(acc, call, residual, channel_dim=1)
