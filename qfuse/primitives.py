"""Quantization numerics in plain torch: the one source of qparam and rounding semantics.

Conventions (tested at the edges in tests/test_primitives.py):
- int8 activations use the full range [-128, 127]; int8 weights use [-127, 127] (symmetric, so
  that negating a weight never overflows and the weight zero point is exactly 0).
- Rounding is round-half-to-even (``torch.round``), the rounding mode of the Triton kernels too.
- Quantize multiplies by the float32 reciprocal of the scale (``x * (1/s)``), never divides: the
  GPU kernels do the same multiply, so CPU and GPU agree bit for bit.
"""

from __future__ import annotations

import torch

INT8_MIN, INT8_MAX = -128, 127
WEIGHT_INT8_MIN, WEIGHT_INT8_MAX = -127, 127
FP8_E4M3_MAX = 448.0
SCALE_EPS = torch.finfo(torch.float32).eps  # torch.ao clamps scales at float32 eps; so do we


def divide(x: torch.Tensor, constant: float) -> torch.Tensor:
    """``x / constant``, correctly rounded on every device. CUDA turns division by a scalar into a
    multiply by its reciprocal (``amax / 127.5`` was 1 ulp off the CPU's on the H200); a divisor
    tensor on x's device keeps it a true division, so scales computed on CPU and GPU agree."""
    return x / torch.full_like(x, constant)


def choose_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    *,
    symmetric: bool,
    qmin: int = INT8_MIN,
    qmax: int = INT8_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float32) and zero point (int32) covering [min_val, max_val] (elementwise).

    Symmetric: ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)``, zero point 0 — for
    activations in [-128, 127] that is ``amax / 127.5`` (torch.ao's definition), for weights in
    [-127, 127] ``amax / 127``. Affine: ``scale = (max - min) / (qmax - qmin)`` over a range that
    always includes 0, ``zero_point = qmin - round(min / scale)``.

    Example:
        >>> import torch
        >>> s, z = choose_qparams(torch.tensor(-1.0), torch.tensor(2.55), symmetric=True)
        >>> round(s.item(), 6), z.item()
        (0.02, 0)
    """
    min_val = torch.clamp(min_val.float(), max=0.0)
    max_val = torch.clamp(max_val.float(), min=0.0)
    if symmetric:
        amax = torch.maximum(-min_val, max_val)
        scale = divide(amax, (qmax - qmin) / 2)
        scale = torch.clamp(scale, min=SCALE_EPS)
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = divide(max_val - min_val, float(qmax - qmin))
        scale = torch.clamp(scale, min=SCALE_EPS)
        zero_point = qmin - torch.round(min_val / scale).to(torch.int32)
        zero_point = torch.clamp(zero_point, qmin, qmax).to(torch.int32)
    return scale.to(torch.float32), zero_point


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """The float32 reciprocal every quantize multiplies by."""
    return torch.reciprocal(scale.to(torch.float32))


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | int = 0,
    *,
    qmin: int = INT8_MIN,
    qmax: int = INT8_MAX,
    axis: int | None = None,
) -> torch.Tensor:
    """int8 ``clamp(round(x * (1/scale)) + zero_point, qmin, qmax)``; per-slice along ``axis``."""
    inv = inverse(scale)
    zp = torch.as_tensor(zero_point, dtype=torch.int32, device=x.device)
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        inv = inv.reshape(shape)
        if zp.dim() > 0:
            zp = zp.reshape(shape)
    q = torch.round(x.float() * inv) + zp.float()
    return torch.clamp(q, qmin, qmax).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | int = 0,
    *,
    axis: int | None = None,
) -> torch.Tensor:
    """float32 ``(q - zero_point) * scale``."""
    scale = scale.to(torch.float32)
    zp = torch.as_tensor(zero_point, dtype=torch.float32, device=q.device)
    if axis is not None:
        shape = [1] * q.dim()
        shape[axis] = -1
        scale = scale.reshape(shape)
        if zp.dim() > 0:
            zp = zp.reshape(shape)
    return (q.float() - zp) * scale


def weight_scale(weight: torch.Tensor, dtype: torch.dtype, per_channel: bool) -> torch.Tensor:
    """The float32 symmetric weight scale, one entry per output channel (the same value repeated
    for per-tensor weights, so the kernels never special-case them): ``amax / 127`` for int8
    ([-127, 127]), ``amax / 448`` for float8 e4m3."""
    flat = weight.detach().float().reshape(weight.shape[0], -1)
    if dtype == torch.float8_e4m3fn:
        amax = flat.abs().amax(dim=1) if per_channel else flat.abs().amax().expand(flat.shape[0])
        return torch.clamp(divide(amax, FP8_E4M3_MAX), min=SCALE_EPS).to(torch.float32)
    if per_channel:
        lo, hi = flat.amin(dim=1), flat.amax(dim=1)
    else:
        lo, hi = flat.amin().expand(flat.shape[0]), flat.amax().expand(flat.shape[0])
    scale, _ = choose_qparams(lo, hi, symmetric=True, qmin=WEIGHT_INT8_MIN, qmax=WEIGHT_INT8_MAX)
    return scale


def weight_codes(w: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The grid value (in units of the scale) that weights ``w`` round to, as float32:
    ``clamp(round(w * inv), -127, 127)`` for int8, the nearest e4m3 value for fp8 (round half
    to even both). ``inv_scale`` broadcasts against ``w``; GPTQ rounds one column at a time with
    this, so its result is exactly what ``quantize_weight*`` store."""
    v = w.float() * inv_scale
    if dtype == torch.float8_e4m3fn:
        v = torch.clamp(v, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return v.to(torch.float8_e4m3fn).to(torch.float32)
    return torch.clamp(torch.round(v), WEIGHT_INT8_MIN, WEIGHT_INT8_MAX)


def _quantize_weight_as(weight, dtype, per_channel, scale):
    if scale is None:
        scale = weight_scale(weight, dtype, per_channel)
    scale = scale.to(device=weight.device, dtype=torch.float32)
    flat = weight.detach().float().reshape(weight.shape[0], -1)
    codes = weight_codes(flat, torch.reciprocal(scale)[:, None], dtype).reshape(weight.shape)
    return codes.to(dtype), scale


def quantize_weight(
    weight: torch.Tensor, per_channel: bool, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weight in [-127, 127] with a float32 scale per output channel (or one).

    Returns ``(q, scale)`` where ``scale`` always has one entry per output channel, so the
    kernels never special-case per-tensor weights. ``scale`` given (GPTQ fixes it before it
    rounds) is used as is.
    """
    return _quantize_weight_as(weight, torch.int8, per_channel, scale)


def quantize_weight_fp8(weight: torch.Tensor, per_channel: bool, scale: torch.Tensor | None = None):
    """float8 e4m3 weight with a float32 scale per output channel (``amax / 448``).

    Same contract as ``quantize_weight``: one scale entry per output channel.
    """
    return _quantize_weight_as(weight, torch.float8_e4m3fn, per_channel, scale)


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | int = 0,
    *,
    qmin: int = INT8_MIN,
    qmax: int = INT8_MAX,
    axis: int | None = None,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in x's dtype: the value a quantized layer actually sees."""
    q = quantize(x, scale, zero_point, qmin=qmin, qmax=qmax, axis=axis)
    return dequantize(q, scale, zero_point, axis=axis).to(x.dtype)
