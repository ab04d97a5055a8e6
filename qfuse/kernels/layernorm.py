"""LayerNorm or RMSNorm (after a residual add) and quantization in one pass over the row.

    y[M, D] = (x - mean) * rstd * weight + bias        (written in x's dtype, if asked)
    q[M, D] = quantize(y as written)                   (int8 with a zero point, or fp8 e4m3)

In a post-LN transformer the LayerNorm output is read twice: as the next block's residual (float)
and as the input of the next GEMMs, which quantize it. Doing both here keeps the row in registers:
one read of x, one float write, one int8/fp8 write, and no quantize pass or prologue work in the
GEMMs that follow. ``q`` quantizes ``y`` after its rounding to x's dtype, which is what a
separately quantizing reader of ``y`` sees, so the fused and unfused graphs agree up to the
LayerNorm's own float rounding (Triton's row reduction against ATen's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import (
    INTERPRETED_JIT,
    quantize_fp8,
    quantize_int8,
    round_to_float_grid,
)


@triton.jit
def to_grid(y, x_ptr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``y`` rounded to x's float dtype, kept in float32: the GPU's own round trip through the
    narrow type rounds to nearest even in two instructions; the interpreter's casts truncate, so
    it rounds by integer ops (``round_to_float_grid``, ~10 an element)."""
    if INTERPRETED_JIT:
        return round_to_float_grid(y, MANT, EMIN)
    else:
        return y.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _ln_quant_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, inv_scale_ptr, zp_ptr, y_ptr, q_ptr,
    # dimensions
    M, D,
    # strides (rows; columns are contiguous)
    stride_xm, stride_ym, stride_qm,
    # meta-parameters (EPS too: Inductor passes a Python float as fp64, which made the whole
    # row fp64 and failed to lower to fp8 on the H200)
    EPS: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_ZP: tl.constexpr, FP8: tl.constexpr,
    WRITE_Y: tl.constexpr, Y_MANT: tl.constexpr, Y_EMIN: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    RMS: tl.constexpr = False, H_MANT: tl.constexpr = 0, H_EMIN: tl.constexpr = 0,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask_m = rows < M
    mask_d = cols < D
    mask = mask_m[:, None] & mask_d[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if RMS:  # RMSNorm as transformers computes it: x * rsqrt(mean(x^2) + eps), cast, * weight
        var = tl.sum(x * x, axis=1) / D
        y = x * (1.0 / tl.sqrt(var + EPS))[:, None]
        if H_MANT > 0:  # hidden.to(input_dtype) before the weight multiplies it
            y = to_grid(y, x_ptr, H_MANT, H_EMIN)
    else:
        mean = tl.sum(x, axis=1) / D
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / D
        rstd = 1.0 / tl.sqrt(var + EPS)
        y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if Y_MANT > 0:  # round to the float output's grid first: what a separate reader quantizes
        y = to_grid(y, x_ptr, Y_MANT, Y_EMIN)
    if WRITE_Y:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)
    inv = tl.load(inv_scale_ptr)
    if FP8:
        q = quantize_fp8(y, inv, EXACT)
    else:
        zp = 0.0
        if HAS_ZP:
            zp = tl.load(zp_ptr).to(tl.float32)
        q = quantize_int8(y, inv, zp, HAS_ZP)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)


_GRIDS = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


# Programs a launch should have at least (two per SM of an H100/H200): a small batch (MiniLM at
# 1x128 is 128 rows) would otherwise run on a few SMs, each program walking several rows.
MIN_PROGRAMS = 256


def rows_per_program(D: int, M: int | None = None) -> int:
    """~4K elements a program: the row stays in registers, without spills; halved (down to one
    row) while ``M`` rows would give fewer than ``MIN_PROGRAMS`` programs."""
    rows = max(1, min(16, 4096 // triton.next_power_of_2(D)))
    while M is not None and rows > 1 and -(-M // rows) < MIN_PROGRAMS:
        rows //= 2
    return rows


def launch_args(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y, interpreted,
                rms=False, schedule=None):
    """Grid, arguments (by name, in the kernel's order: the 7 pointers and M first), launch
    options and the outputs ``(y, q)`` of one launch over 2-D ``x`` [M, D]. ``schedule``
    ``(rows per program, warps)`` overrides the default (benchmarks)."""
    M, D = x.shape
    y = torch.empty((M, D) if write_y else (0,), device=x.device, dtype=x.dtype)
    q = torch.empty((M, D), device=x.device, dtype=qdtype)
    mant, emin = _GRIDS.get(x.dtype, (0, 0))  # integer rounding: exact on GPU and interpreter
    dummy = inv_scale
    block_m, warps = schedule or (rows_per_program(D, M), 4)
    args = dict(
        x_ptr=x, w_ptr=weight if weight is not None else dummy,
        b_ptr=bias if bias is not None else dummy, inv_scale_ptr=inv_scale,
        zp_ptr=zero_point if zero_point is not None else dummy,
        y_ptr=y if write_y else q, q_ptr=q,
        M=M, D=D, stride_xm=x.stride(0), stride_ym=D, stride_qm=q.stride(0), EPS=float(eps),
        HAS_W=weight is not None, HAS_B=bias is not None, HAS_ZP=zero_point is not None,
        FP8=qdtype == torch.float8_e4m3fn, WRITE_Y=write_y, Y_MANT=mant, Y_EMIN=emin,
        EXACT=interpreted, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(D),
        RMS=rms, H_MANT=mant if rms else 0, H_EMIN=emin if rms else 0,
    )
    return (-(-M // block_m),), args, dict(num_warps=warps), y, q


def layer_norm_quant(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y, interpreted,
                     wrap=None, rms=False, schedule=None):
    """LayerNorm (``rms``: RMSNorm) over the last dim of 2-D ``x`` [M, D] and its quantization:
    ``(y, q)``, ``y`` empty when ``write_y`` is False. ``wrap``: ``torch.library.wrap_triton``
    when traced. ``schedule``: see ``launch_args``."""
    grid, args, options, y, q = launch_args(x, weight, bias, eps, inv_scale, zero_point, qdtype,
                                            write_y, interpreted, rms, schedule)
    kernel = wrap(_ln_quant_kernel) if wrap is not None else _ln_quant_kernel
    kernel[grid](**args, **options)
    return y, q
