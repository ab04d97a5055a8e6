"""Depthwise quantized Conv2d (groups == channels, one input channel per group), int8 or fp8 e4m3.

    acc[m, c] = sum_tap (x_q[pixel(m) + tap, c] - zp_x) * W_q[c, tap]    m = (batch, oh, ow)
    out = requant?( post_act( (+ residual)( act(acc * scale[c] + bias[c]) ) ) )

A direct kernel, no GEMM: a tile of pixels by a block of channels, one multiply-accumulate per
(kh, kw) tap, accumulated in float32 (exact for int8, see the kernel). Input quantization (in
the prologue, or read as int8/fp8 when ``implicit.prequantize`` or the previous fused conv did it)
and the epilogue (``epilogue.conv_epilogue``: scale, bias, act, residual, post-act, requant in
the reference's order, ``enable_fp_fusion=False``) are the implicit-GEMM conv's, so int8 outputs
are bit-identical to ``ops.reference.qconv2d``. ``implicit.qconv2d`` dispatches here; this module
holds the kernel, its tile heuristic and its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import (
    INTERPRETED,
    ConvConfig,
    input_qparams,
    load_quantized,
    pixel_coords,
)
from qfuse.kernels.epilogue import conv_epilogue


@triton.jit(do_not_specialize=["M"])
def _dwconv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, x_inv_scale_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    res_scale_ptr, res_zp_ptr, out_inv_scale_ptr, out_zp_ptr, out_ptr,
    M, H, W, OH, OW, C,
    sxn, sxh, sxw, sxc, swo, swh, sww, stride_rm, stride_om,
    SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RES_Q: tl.constexpr, HAS_RES_ZP: tl.constexpr,
    POST_ACT: tl.constexpr, OUT_Q: tl.constexpr,
    HAS_OUT_ZP: tl.constexpr, OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Depthwise (groups == C, one output channel per input channel): direct MACs per tap.
    The implicit-GEMM conv's arguments (``wsum_ptr`` unused: the zero point is subtracted per
    tap)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_c = offs_c < C
    batch, oh, ow = pixel_coords(offs_m, OH, OW)
    x_rows = x_ptr + batch.to(tl.int64) * sxn
    x_inv_scale, x_zp, x_zp_q = input_qparams(x_inv_scale_ptr, x_zp_ptr, X_QUANTIZED, HAS_X_ZP)
    # float32 for int8 too: every product and partial sum is an integer below 2**24 (at most
    # 49 taps x 255 x 127), so the sum is exact, and float FMA-free math beats int32 multiplies
    # (measured more than twice as fast on the H200 for a 5x5 depthwise conv).
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(KH * KW):
        ih = oh * SH - PH + (tap // KW) * DH
        iw = ow * SW - PW + (tap % KW) * DW
        valid = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        mask = valid[:, None] & mask_c[None, :]
        ptrs = (x_rows + ih * sxh + iw * sxw)[:, None] + (offs_c * sxc)[None, :]
        w_ptrs = w_ptr + offs_c * swo + (tap // KW) * swh + (tap % KW) * sww
        w = tl.load(w_ptrs, mask=mask_c, other=0.0)
        av = load_quantized(ptrs, mask, x_inv_scale, x_zp, x_zp_q, FP8, X_QUANTIZED, HAS_X_ZP,
                            EXACT).to(tl.float32)
        if HAS_X_ZP:  # padding contributes (zp - zp) * w = 0: the reference's conv(q - zp)
            av = tl.where(mask, av - x_zp, 0.0)
        acc += av * w.to(tl.float32)[None, :]
    if not FP8:
        acc = acc.to(tl.int32)
    conv_epilogue(
        acc, offs_m, offs_c, mask_m, mask_c,
        scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
        out_inv_scale_ptr, out_zp_ptr, out_ptr, stride_rm, stride_om,
        False, HAS_BIAS, ACT, HAS_RESIDUAL, RES_Q, HAS_RES_ZP, POST_ACT, OUT_Q, HAS_OUT_ZP,
        OUT_MANT, OUT_EMIN, EXACT,
    )


def pick_depthwise_config(M: int, channels: int, taps: int = 9) -> ConvConfig:
    """Depthwise tiles: 1024 outputs per 4-warp program (8 per thread). The taps are unrolled
    and each holds its loaded tile, so bigger tiles run out of registers: on the H200 (GPU
    time, int8, N=32) a 5x5 96-channel 14x14 layer took 3x as long in 32x64 tiles as in 32x32
    (on a par with cuDNN bf16), 20x in 64x64."""
    if INTERPRETED:
        return ConvConfig(32, 32, 0, 4, 1)
    block_c = 32 if channels >= 32 else 16
    return ConvConfig(1024 // block_c, block_c, 0, 4, 1)


def dwconv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, operands: tuple,
           flags: dict, config: ConvConfig | None = None, launch=None) -> torch.Tensor:
    """Launch ``_dwconv_kernel`` for ``implicit.qconv2d``: ``x`` [N, C, H, W] (any strides) and
    ``weight`` [C, 1, KH, KW] into ``out``, the channels-last [N, C, OH, OW] tensor
    ``qconv2d`` allocated. ``operands``: the conv kernels' tensors between weight and output,
    in their order (scale, bias, x_inv_scale, x_zero_point, weight_sum, residual,
    residual_scale, residual_zero_point, out_inv_scale, out_zero_point), absent ones replaced
    by a never-read dummy; ``flags``: the constexprs ``qconv2d`` builds for every conv kernel;
    ``launch`` wraps the kernel before its launch."""
    launch = launch or (lambda k: k)
    n, _, h, w = x.shape
    c_out, _, kh, kw = weight.shape
    oh, ow = out.shape[2], out.shape[3]
    M = n * oh * ow
    cfg = config or pick_depthwise_config(M, c_out, kh * kw)
    block_m, block_c = cfg.block_m, cfg.block_n
    grid = (triton.cdiv(M, block_m), triton.cdiv(c_out, block_c))
    sx = x.stride()
    sw = weight.stride()
    launch(_dwconv_kernel)[grid](
        x, weight, *operands, out,
        M, h, w, oh, ow, c_out,
        sx[0], sx[2], sx[3], sx[1], sw[0], sw[2], sw[3], c_out, c_out,
        **flags, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )
    return out
