"""Fake quantization with a straight-through estimator, on exactly the converted layers' grid.

Forward values come from the functions the converted model runs: activations through
``ops.reference.quantize_int8`` / ``quantize_fp8`` / ``quantize_per_token`` (the CPU path of the
fused kernels and their test oracle), weights through ``primitives.weight_scale`` /
``weight_codes`` (what ``QLinear.from_float`` stores). So the fake-quant forward of a layer is
the converted layer's computation, with only the float matmul's rounding in between.

Backward: the straight-through estimator (gradient 1 inside the grid, 0 where the value
clipped) for the input, and LSQ's gradient for a learnable scale (Esser et al., 2020):
``d out / d s = Q(v) - v`` inside the grid, the clip bound outside, times
``1 / sqrt(numel * qmax)`` so the scale learns at the rate of the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qfuse.ops.reference import quantize_fp8, quantize_int8, quantize_per_token
from qfuse.primitives import (
    FP8_E4M3_MAX,
    INT8_MAX,
    INT8_MIN,
    SCALE_EPS,
    WEIGHT_INT8_MAX,
    WEIGHT_INT8_MIN,
    dequantize,
    inverse,
    weight_codes,
    weight_scale,
)

FP8 = torch.float8_e4m3fn
# Observers give the symmetric int8 activation scale amax / 127.5; fp8 e4m3 spans amax / 448.
# convert rescales by this factor (the same float), so fake-quant does too.
FP8_FROM_INT8 = ((INT8_MAX - INT8_MIN) / 2) / FP8_E4M3_MAX


@dataclass(frozen=True)
class Grid:
    """Where a tensor's values land: ``codes(x, inv, zp)`` (float, zero point included) and the
    code range [lo, hi] (for the STE mask and LSQ's clip gradient)."""

    kind: str  # "act_int8" | "act_fp8" | "weight_int8" | "weight_fp8"

    @property
    def bounds(self) -> tuple[float, float]:
        if self.kind.endswith("fp8"):
            return -FP8_E4M3_MAX, FP8_E4M3_MAX
        if self.kind == "weight_int8":
            return float(WEIGHT_INT8_MIN), float(WEIGHT_INT8_MAX)
        return float(INT8_MIN), float(INT8_MAX)

    def codes(self, x: torch.Tensor, inv: torch.Tensor, zp) -> torch.Tensor:
        if self.kind == "act_int8":
            return quantize_int8(x, inv, zp).float()
        if self.kind == "act_fp8":
            return quantize_fp8(x, inv).float()
        return weight_codes(x, inv, FP8 if self.kind == "weight_fp8" else torch.int8)


class _FakeQuant(torch.autograd.Function):
    """``(codes(x * inv) - zp) * scale``; STE for x, LSQ for ``scale`` (when it needs grad).

    ``inv`` is the exact multiplier the converted kernel uses (``1/scale``, or SmoothQuant's
    prologue vector); ``pre`` is d(x * inv * scale)/dx (1, or the smoothing vector 1/s).
    ``reduce_dims`` sum LSQ's per-element gradient down to the scale's shape.
    """

    @staticmethod
    def forward(ctx, x, scale, inv, zp, pre, grid, reduce_dims, lsq_factor):
        xf = x.float()
        zpf = zp.float() if isinstance(zp, torch.Tensor) else float(zp)
        codes = grid.codes(xf, inv, zpf)
        out = (codes - zpf) * scale
        ctx.save_for_backward(xf, inv, codes, scale)
        ctx.zp, ctx.pre, ctx.grid = zpf, pre, grid
        ctx.reduce_dims, ctx.lsq_factor = reduce_dims, lsq_factor
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xf, inv, codes, scale = ctx.saved_tensors
        lo, hi = ctx.grid.bounds
        v = xf * inv
        inside = (v + ctx.zp >= lo) & (v + ctx.zp <= hi)
        grad = grad.float()
        grad_x = grad * inside
        if ctx.pre is not None:
            grad_x = grad_x * ctx.pre
        grad_scale = None
        if ctx.needs_input_grad[1]:
            per_element = (codes - ctx.zp) - v * inside  # Q(v) - v inside, the clip bound outside
            g = (grad * per_element).sum(dim=ctx.reduce_dims, keepdim=True)
            grad_scale = (g * ctx.lsq_factor).reshape(scale.shape)
        return grad_x.to(xf.dtype), grad_scale, None, None, None, None, None, None


def lsq_factor(numel: int, grid: Grid) -> float:
    """LSQ's gradient scale ``1 / sqrt(numel * qmax)``."""
    return 1.0 / math.sqrt(max(numel, 1) * grid.bounds[1])


def fake_quantize_activation(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    dtype: torch.dtype,
    smoothing: torch.Tensor | None = None,
) -> torch.Tensor:
    """Static per-tensor fake quant of an activation as the fused layer's prologue does it.

    ``scale`` is the int8-convention scale an observer gives (convert rescales it for fp8);
    ``smoothing`` (SmoothQuant's factors s) quantizes ``x / s`` with the prologue vector
    ``(1/s) * (1/scale)``, exactly as convert builds it.

    Example:
        >>> import torch
        >>> from qfuse.primitives import fake_quantize
        >>> x, s, z = torch.randn(4, 8), torch.tensor(0.02), torch.tensor(3, dtype=torch.int32)
        >>> torch.equal(fake_quantize_activation(x, s, z, torch.int8), fake_quantize(x, s, z))
        True
    """
    fp8 = dtype == FP8
    scale = torch.clamp(scale, min=SCALE_EPS)
    grid = Grid("act_fp8" if fp8 else "act_int8")
    zp = zero_point if not fp8 else 0
    pre = None
    if smoothing is not None:
        pre = inverse(smoothing)
        inv = (pre * inverse(scale.detach())).float()  # convert's prologue vector
        inv = inv / FP8_FROM_INT8 if fp8 else inv
    if fp8:
        scale = scale * FP8_FROM_INT8
    if smoothing is None:
        inv = inverse(scale.detach())
    numel = x.numel() // max(x.shape[0], 1)  # LSQ's N: features per sample
    factor = lsq_factor(numel, grid)
    dims = tuple(range(x.dim()))
    return _FakeQuant.apply(x, scale, inv, zp, pre, grid, dims, factor)


def fake_quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dynamic per-token fake quant (the scale never clips, so the STE passes every gradient).

    Example:
        >>> import torch
        >>> x = torch.randn(3, 5, requires_grad=True)
        >>> y = fake_quantize_per_token(x, torch.int8)
        >>> y.sum().backward()
        >>> bool((y - x).abs().max() < 0.05), torch.equal(x.grad, torch.ones(3, 5))
        (True, True)
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    q, scale = quantize_per_token(rows, dtype)
    out = dequantize(q.float(), scale, axis=0).reshape(x.shape).to(x.dtype)
    return x + (out - x).detach()


def weight_scale_like_convert(weight: torch.Tensor, dtype: torch.dtype, per_channel: bool):
    """The scale convert computes for this weight (``primitives.weight_scale``), detached."""
    return weight_scale(weight.detach(), dtype, per_channel)


def fake_quantize_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, per_channel: bool
) -> torch.Tensor:
    """Weight fake quant on the symmetric grid ``QLinear.from_float`` stores, one ``scale`` per
    output channel (learnable for LSQ, else ``weight_scale_like_convert``; per-tensor weights
    repeat one value, as convert stores them).

    Example:
        >>> import torch
        >>> from qfuse.primitives import quantize_weight, dequantize
        >>> w = torch.randn(6, 10)
        >>> s = weight_scale_like_convert(w, torch.int8, per_channel=True)
        >>> q, s2 = quantize_weight(w, per_channel=True)
        >>> torch.equal(fake_quantize_weight(w, s, torch.int8, True), dequantize(q, s2, axis=0))
        True
    """
    fp8 = dtype == FP8
    grid = Grid("weight_fp8" if fp8 else "weight_int8")
    scale = torch.clamp(scale, min=SCALE_EPS)
    flat = weight.reshape(weight.shape[0], -1)
    inv = torch.reciprocal(scale.detach().float())[:, None]  # as _quantize_weight_as
    numel = flat.shape[1] if per_channel else flat.numel()
    out = _FakeQuant.apply(flat, scale[:, None], inv, 0, None, grid, (1,), lsq_factor(numel, grid))
    return out.reshape(weight.shape)
