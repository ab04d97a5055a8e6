"""The epilogue pieces the GEMM and conv kernels share: scaling the accumulator, and writing the
result (requantized to int8/fp8, or float).

    y   = (acc - zp_x * colsum(W)) * scale[n] [* x_scale[m]] + bias[n]      (``scale_acc``)
    out = quantize(y) with a static scale, or y in the output's float dtype (``store_output``)

Both keep the CPU reference's order and rounding: every product is an explicitly rounded
``mul_rn`` (no FMA with the following add, even where torch.compile launches the kernel), and
interpreted kernels round narrow float outputs with integer ops (``round_to_float_grid``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import (
    GATED_FROM,
    INTERPRETED,
    activation,
    gated,
    mul_rn,
    quantize_fp8,
    quantize_int8,
    round_to_float_grid,
)

# Output quantization codes (the kernels' OUT_Q constexpr).
OUT_FLOAT, OUT_INT8, OUT_FP8 = 0, 1, 2

# (stored mantissa bits, smallest normal exponent) of the narrow float outputs; see
# common.round_to_float_grid for why the interpreter needs them.
_FLOAT_GRIDS = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


def output_code(out_dtype: torch.dtype) -> int:
    return {torch.int8: OUT_INT8, torch.float8_e4m3fn: OUT_FP8}.get(out_dtype, OUT_FLOAT)


def float_grid(out_dtype: torch.dtype) -> tuple[int, int]:
    """``(OUT_MANT, OUT_EMIN)`` for a float output: rounded by integer ops in the interpreter
    only; the GPU's own cast rounds to nearest even."""
    return _FLOAT_GRIDS.get(out_dtype, (0, 0)) if INTERPRETED else (0, 0)


@triton.jit
def scale_acc(acc, offs_m, offs_n, mask_m, mask_n, scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr,
              wsum_ptr, X_ROW_SCALE: tl.constexpr, HAS_X_ZP: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """Zero-point correction, per-channel (and per-row) scales and bias, in float32."""
    if HAS_X_ZP:
        wsum = tl.load(wsum_ptr + offs_n, mask=mask_n, other=0)
        acc = acc - tl.load(x_zp_ptr) * wsum[None, :]
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = mul_rn(acc.to(tl.float32), scale[None, :])
    if X_ROW_SCALE:
        y = mul_rn(y, tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None])
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    return y


@triton.jit
def start_acc(offs_n, N, x_zp_ptr, wsum_ptr, FIRST, FP8: tl.constexpr, ZP_CORR: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The accumulator a tile's K loop starts from: zeros, or (``ZP_CORR``, int8 with an
    activation zero point) ``-zp_x * colsum(W)[n]`` in every row, so the loop's sum is already
    ``acc - zp_x * colsum(W)`` and the epilogue skips the correction (``HAS_X_ZP=False`` to
    ``finish_tile``). Integer addition is exact, so the result is bit-identical to correcting
    afterwards; the column sums are live only before the loop, where the accumulator is not
    yet, instead of beside it in the epilogue (an asymmetric GELU tile spilled there).
    ``FIRST``: whether this program's K range starts at 0 (under split-K only that partial
    takes the correction)."""
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        if ZP_CORR:
            wsum = tl.load(wsum_ptr + offs_n, mask=offs_n < N, other=0)
            corr = tl.where(FIRST, tl.load(x_zp_ptr) * wsum, 0)
            acc = acc - corr[None, :]
    return acc


@triton.jit
def store_output(y, out_ptrs, mask, out_inv_scale_ptr, out_zp_ptr, OUT_Q: tl.constexpr,
                 HAS_OUT_ZP: tl.constexpr, OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr,
                 EXACT: tl.constexpr):
    """``y`` requantized (int8 with an optional zero point, fp8) or in the output's dtype."""
    if OUT_Q == 1:
        out_zp = 0.0
        if HAS_OUT_ZP:
            out_zp = tl.load(out_zp_ptr).to(tl.float32)
        tl.store(out_ptrs, quantize_int8(y, tl.load(out_inv_scale_ptr), out_zp, HAS_OUT_ZP),
                 mask=mask)
    elif OUT_Q == 2:
        tl.store(out_ptrs, quantize_fp8(y, tl.load(out_inv_scale_ptr), EXACT), mask=mask)
    else:
        if OUT_MANT > 0:
            y = round_to_float_grid(y, OUT_MANT, OUT_EMIN)
        tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)


# ---- the conv kernels' epilogue (conv and depthwise) ----

@triton.jit
def conv_epilogue(
    acc, offs_m, offs_n, mask_m, mask_n,
    scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
    out_inv_scale_ptr, out_zp_ptr, out_ptr,
    stride_rm, stride_om,
    HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    RES_Q: tl.constexpr, HAS_RES_ZP: tl.constexpr,
    POST_ACT: tl.constexpr, OUT_Q: tl.constexpr, HAS_OUT_ZP: tl.constexpr,
    OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr,
):
    """Reference order: zero-point correction, scale, bias, act, residual, post-act, requant.
    ``offs_n`` are global output channels; residual and output are [M, C] rows (channels-last).
    A quantized residual (``RES_Q``: int8/fp8 handed over by the conv that computed it) is
    dequantized as ``(r - zp) * scale`` before the add."""
    y = scale_acc(acc, offs_m, offs_n, mask_m, mask_n, scale_ptr, scale_ptr, bias_ptr, x_zp_ptr,
                  wsum_ptr, False, HAS_X_ZP, HAS_BIAS)
    y = activation(y, ACT)
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + rows[:, None] * stride_rm + offs_n[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        if RES_Q:
            if HAS_RES_ZP:
                r = r - tl.load(res_zp_ptr).to(tl.float32)
            r = mul_rn(r, tl.load(res_scale_ptr))
        y = y + r
    y = activation(y, POST_ACT)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    store_output(y, out_ptrs, mask, out_inv_scale_ptr, out_zp_ptr, OUT_Q, HAS_OUT_ZP, OUT_MANT,
                 OUT_EMIN, EXACT)


# ---- the GEMM kernel's tile epilogue ----

@triton.jit
def column_parts(acc, PARTS: tl.constexpr):
    """A tile's ``PARTS`` column parts, as ``(first, second)``: ``(acc, acc)`` for one part, or
    its left and right halves. An epilogue run on the halves one after the other holds half
    the registers live: every elementwise op of the epilogue materializes a whole part."""
    if PARTS == 1:
        return acc, acc
    else:
        return tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, acc.shape[1] // 2)),
                                   (0, 2, 1)))


@triton.jit
def finish_tile(
    acc, offs_m, pid_n, M, N,
    scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, out_inv_scale_ptr,
    out_zp_ptr, out_ptr,
    stride_rm, stride_rn, stride_om, stride_on,
    X_ROW_SCALE: tl.constexpr, HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, OUT_Q: tl.constexpr, HAS_OUT_ZP: tl.constexpr,
    OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr, FAST_ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, EPI_SPLIT: tl.constexpr,
):
    """Zero-point correction, scales, bias, activation, residual, requant — reference order —
    on the tile of rows ``offs_m`` and column block ``pid_n``: the whole tile, or
    (``EPI_SPLIT == 2``) its two column halves one after the other (``column_parts``)."""
    WIDTH: tl.constexpr = BLOCK_N // EPI_SPLIT
    first, second = column_parts(acc, EPI_SPLIT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, WIDTH)
    for part in tl.static_range(EPI_SPLIT):
        mask_m = offs_m < M
        mask_n = offs_n < N
        y = scale_acc(first if part == 0 else second, offs_m, offs_n, mask_m, mask_n, scale_ptr,
                      x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, X_ROW_SCALE, HAS_X_ZP, HAS_BIAS)
        cols = offs_n
        if ACT >= GATED_FROM:  # SwiGLU / GeGLU: N interleaved gate/up columns -> N / 2 outputs
            y, cols = gated(y, offs_n, ACT, FAST_ACT)
            mask_n = cols < N // 2
        else:
            y = activation(y, ACT, FAST_ACT)
        mask = mask_m[:, None] & mask_n[None, :]
        if HAS_RESIDUAL:
            r_ptrs = res_ptr + offs_m[:, None] * stride_rm + cols[None, :] * stride_rn
            y = y + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + cols[None, :] * stride_on
        store_output(y, out_ptrs, mask, out_inv_scale_ptr, out_zp_ptr, OUT_Q, HAS_OUT_ZP,
                     OUT_MANT, OUT_EMIN, EXACT)
        offs_n += WIDTH


@triton.jit
def k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's K tiles ``[k_first, k_end)``: all of K, or under split-K (grid axis 1:
    the split) its share."""
    k_end = tl.cdiv(K, BLOCK_K)
    k_first = 0
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_end, SPLIT_K)
        k_first = tl.program_id(1) * per_split
        k_end = tl.minimum(k_end, k_first + per_split)
    return k_first, k_end


@triton.jit
def split_k_reduce(acc, offs_m, offs_n, M, N, ws_ptr, lock_ptr, SPLIT_K: tl.constexpr):
    """Split-K without a second launch: store this program's partial ``acc`` in the workspace
    [SPLIT_K, M, N], count arrivals on the tile's counter ``lock_ptr``; the last program to
    arrive sums every partial in split order (deterministic, float sums included), resets the
    counter for the next launch and returns ``(sum, True)``; the others ``(acc, False)``."""
    tile = offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(ws_ptr + tl.program_id(1) * M * N + tile, acc, mask=mask)
    # The barrier makes every thread's partial part of this program's release below.
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = arrived == SPLIT_K - 1
    if is_last:
        acc = tl.zeros_like(acc)
        for s in range(0, SPLIT_K):  # fixed order: deterministic float sums too
            part = ws_ptr + s * M * N + tile
            acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr, 0)  # ready for the next launch
    return acc, is_last
