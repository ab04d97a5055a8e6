"""The stem's patch matrix: a quantized im2col for convs with few input channels.

A 7x7 stride-2 stem over 3 channels would make the implicit GEMM (``implicit``) gather one
byte per A element and per tap; a 1x1 GEMM over this buffer reads 16-byte runs instead.
``implicit.qconv2d`` builds the buffer with ``im2col`` and runs its GEMM kernel over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import INTERPRETED, quantize_fp8, quantize_int8

FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["M"])
def _im2col_kernel(x_ptr, inv_scale_ptr, zp_ptr, cols_ptr, M, H, W, OH, OW, C, K, KP,
                   sxn, sxh, sxw, sxc,
                   SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                   DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                   FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, HAS_ZP: tl.constexpr,
                   EXACT: tl.constexpr, BLOCK_M: tl.constexpr, RUN: tl.constexpr):
    """``cols[m, k]``, k = (kh, kw, c): the quantized input patch of output pixel m, the
    quantized zero (the zero point) at padding taps and past K (weights there are masked).
    Program (i, kh) copies kernel row kh of BLOCK_M pixels: KW*C values per pixel, contiguous
    in channels-last memory when the dilation is 1; program (i, KH) fills the columns past K.
    Per element only a column offset and two bounds checks are 2-D: the gather is ALU-bound."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kh = tl.program_id(1)
    mask_m = offs_m < M
    j = tl.arange(0, RUN)
    run = KW * C
    zp_q = 0.0
    if HAS_ZP:
        zp_q = tl.load(zp_ptr).to(tl.float32)
    out_rows = cols_ptr + offs_m.to(tl.int64) * KP
    if kh == KH:  # columns K..KP: any value times a masked weight; the zero point, as padding
        tail = K + j
        fill = tl.zeros((BLOCK_M, RUN), dtype=tl.float32) + zp_q
        tl.store(out_rows[:, None] + tail[None, :], fill.to(cols_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & (tail < KP)[None, :])
    else:
        ow = offs_m % OW
        oh = (offs_m // OW) % OH
        ih = oh * SH - PH + kh * DH
        iw0 = ow * SW - PW
        row_ok = mask_m & (ih >= 0) & (ih < H)
        base = ((offs_m // OW) // OH).to(tl.int64) * sxn + ih * sxh + iw0 * sxw
        kw = j // C
        col = (kw * DW) * sxw + (j % C) * sxc
        iw = iw0[:, None] + (kw * DW)[None, :]
        inside = row_ok[:, None] & (j < run)[None, :] & (iw >= 0) & (iw < W)
        ptrs = x_ptr + base[:, None] + col[None, :]
        if X_QUANTIZED:
            q = tl.load(ptrs, mask=inside, other=0.0)
            if HAS_ZP:
                q = tl.where(inside, q, zp_q.to(tl.int8))
        else:  # quantize(0.0) is the zero point: padding needs no special case
            x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
            if FP8:
                q = quantize_fp8(x, tl.load(inv_scale_ptr), EXACT)
            else:
                q = quantize_int8(x, tl.load(inv_scale_ptr), zp_q)
        out = out_rows[:, None] + (kh * run + j)[None, :]
        tl.store(out, q, mask=mask_m[:, None] & (j < run)[None, :])


def im2col(x, qdtype, kernel, stride, padding, dilation, oh, ow, x_inv_scale, x_zero_point,
           launch):
    """The quantized patch matrix ``[N*OH*OW, KP]`` (KP = KH*KW*C rounded up to 16 bytes) of
    a conv with few input channels (a stem): the implicit GEMM would gather one byte per A
    element and per tap; a 1x1 GEMM over this buffer reads 16-byte runs (measured faster on the
    H200 for the 7x7 stride-2 stem)."""
    n, c, h, w = x.shape
    kh, kw = kernel
    k = kh * kw * c
    kp = -(-k // 16) * 16
    m = n * oh * ow
    cols = torch.empty((m, kp), device=x.device, dtype=qdtype)
    run = triton.next_power_of_2(max(kw * c, kp - k, 1))
    block_m = 32 if INTERPRETED else max(4096 // run, 16)
    sx = x.stride()
    launch(_im2col_kernel)[(triton.cdiv(m, block_m), kh + 1)](
        # absent scalars: x as the (never read) dummy, not cols: a buffer passed both as an
        # input and as the written output breaks Inductor's mutation analysis (KeyError 'opN')
        x, x_inv_scale if x_inv_scale is not None else x,
        x_zero_point if x_zero_point is not None else x, cols,
        m, h, w, oh, ow, c, k, kp, sx[0], sx[2], sx[3], sx[1],
        SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0],
        DW=dilation[1], KH=kh, KW=kw, FP8=qdtype == FP8,
        X_QUANTIZED=x.dtype in (torch.int8, FP8), HAS_ZP=x_zero_point is not None,
        EXACT=INTERPRETED, BLOCK_M=block_m, RUN=run,
        num_warps=4, enable_fp_fusion=False,
    )
    return cols
