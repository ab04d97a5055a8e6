"""The stem conv (a kxk conv over few input channels) as an implicit GEMM with gathered A tiles.

    out[m, n] = sum_k q(x[batch(m), c(k), ih(m, k), iw(m, k)]) * W[n, k]
    ih = oh(m)*SH - PH + kh(k)*DH,  iw = ow(m)*SW - PW + kw(k)*DW
    k = (kh, kw, c) flattened, K = KH*KW*C (147 for ResNet's 7x7 RGB stem)

Each program owns BLOCK_M output pixels and BLOCK_N output channels; its K loop gathers the
patch tile straight from the input (computed addresses, padding masked to the quantized zero),
quantizes a float input in registers with ``common.quantize_int8``/``quantize_fp8`` (the
functions the prologue and ``quantize`` use, so the int8 values equal the patch buffer's) or
reads one ``implicit.prequantize`` quantized in its own pass (``StemConfig.prequantize``), and
feeds ``tl.dot`` with the packed weight's contiguous K. No patch buffer: ``im2col`` wrote
and re-read 160 bytes per output pixel (64 MB at batch 32) where this reads only the input, which
the 49 taps re-read from L1/L2.

The gather is the kernel's cost (the GEMM is ~8 GFLOP), issue-bound rather than bandwidth-bound:
every A element costs a load, a mask, an address and (float input) a quantization. It is
cheapest with a warp's 32 lanes on neighbouring output pixels, each lane holding all BLOCK_K
columns of its pixel: with the K loop unrolled, a column's (kh, kw, c) are compile-time
constants, the bounds checks reduce to KH + KW compares per pixel, and a warp's load spans SW
elements per lane (NCHW: one or two 128-byte lines; channels-last: SW*C, three or four). With
lanes along K the pixel terms are recomputed per element: compiled for sm_90 (7x7x3, 128x64x32
tiles, bf16 in, int8 out), ~46-49 SASS instructions per gathered element and 120-170 spill
stores per lane against ~30 and at most four.

Which axis the lanes take is Triton's choice (its coalescing pass, with no contiguity along
either axis of the gathered addresses): the first axis of the tile on Triton 3.6, the last on
3.7 (sm_90 TTGIR of this kernel under both). ``StemConfig.kmajor`` sets the orientation the
tile is built in, [BLOCK_K, BLOCK_M] (fed to the dot as its K-major B operand, out^T = W @
patches^T) or [BLOCK_M, BLOCK_K] (the A operand), and ``PIXEL_FAST_KMAJOR`` is the orientation
that puts the lanes on pixels under the installed Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import (
    INTERPRETED,
    check_fp8_promote,
    dot_acc,
    input_qparams,
    load_quantized,
    pixel_coords,
)
from qfuse.kernels.epilogue import conv_epilogue

FP8 = torch.float8_e4m3fn
PIXEL_FAST_KMAJOR = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)


@dataclass(frozen=True)
class StemConfig:
    """A schedule of ``_stem_kernel``: tile sizes, warps and pipeline depth as in
    ``ConvConfig``, plus ``kmajor`` (the gathered tile's orientation, which decides whether
    the compiler puts its lanes on pixels or on K: see the module docstring), ``prequantize``
    (quantize a float input in its own pass first and gather bytes, instead of quantizing
    each gathered element in registers; each input element is in ~KH*KW/(SH*SW) patches, 12
    for the 7x7 stride-2 stem) and ``maxnreg`` (a register cap for ptxas: more resident
    programs; it spills if set too low)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    kmajor: bool
    prequantize: bool
    fp8_promote: int = 0
    maxnreg: int | None = None

    def __post_init__(self):
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise UnsupportedError(f"StemConfig: maxnreg={self.maxnreg}; use 24..255 or None.")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise UnsupportedError(f"StemConfig: {name}={v}; use a power of two >= 16.")
        check_fp8_promote(self, self.block_k)


def stem_candidates(c_out: int) -> list[StemConfig]:
    """Schedules worth timing for a stem, best guess first (``pick_stem_config`` takes the
    first; ``bench/stem_ab.py`` times them all). Not yet ranked by a measurement; the reasons,
    from the sm_90 SASS of the 7x7x3 stem under Triton 3.6 and 3.7 (registers per lane,
    instructions per gathered element, epilogue included), lanes on pixels: 32-wide K steps
    pad K = 147 to 160 (64-wide: 192 and spills); 128x64 on 4 warps: ~21 instructions per
    element gathering a separately quantized input (``prequantize``: its own pass reads the
    input and writes a byte per element, once, where quantizing in registers repeats it in
    each of the ~12 patches an element is in) against ~30 in registers; that variant also
    fits 168 registers unspilled (3 programs per SM instead of 2); 256 pixels on 8 warps
    ~29-30; 64 pixels, or 8 warps on 128, spread each lane's overhead over half the elements
    (~46-50). Last, the other orientation (lanes on K), as the bench's evidence. One stage:
    the unrolled K loop has nothing to pipeline; resident programs overlap instead."""
    n = max(16, min(triton.next_power_of_2(c_out), 64))
    fast = PIXEL_FAST_KMAJOR
    return [
        StemConfig(128, n, 32, 4, 1, fast, True),
        StemConfig(128, n, 32, 4, 1, fast, False),
        StemConfig(128, n, 32, 4, 1, fast, True, maxnreg=168),
        StemConfig(256, n, 32, 8, 1, fast, False),
        StemConfig(128, n, 32, 4, 1, not fast, False),
    ]


def pick_stem_config(c_out: int) -> StemConfig:
    best = stem_candidates(c_out)[0]
    if INTERPRETED:  # interpreter cost grows with tile size: smallest legal tiles
        return replace(best, block_m=32, block_n=min(best.block_n, 32), num_warps=4, maxnreg=None)
    return best


@triton.jit
def _patch_tile(x_pix, ih0, iw0, mask_m, k0, H, W, sxh, sxw, sxc,
                x_inv_scale, x_zp, x_zp_q,
                C: tl.constexpr, KW: tl.constexpr, K: tl.constexpr, DH: tl.constexpr,
                DW: tl.constexpr, FP8: tl.constexpr, X_QUANTIZED: tl.constexpr,
                HAS_X_ZP: tl.constexpr, EXACT: tl.constexpr, BLOCK_K: tl.constexpr,
                KMAJOR: tl.constexpr):
    """The quantized patch tile of K columns k0..k0+BLOCK_K: padding taps are the quantized
    zero (the zero point), columns past K anything (their weights load as 0). [BLOCK_M,
    BLOCK_K], or with ``KMAJOR`` [BLOCK_K, BLOCK_M], which the kernel feeds to the dot as its
    B operand: 8-bit wgmma operands are K-major in shared memory, so with lanes on pixels
    each lane's BLOCK_K bytes store as one run (sm_90 SASS: 16-byte shared stores), where
    transposing the tile into the A operand went through shared memory twice, byte by byte."""
    k = k0 + tl.arange(0, BLOCK_K)
    c = k % C
    tap = k // C
    dh = (tap // KW) * DH
    dw = (tap % KW) * DW
    col_off = dh * sxh + dw * sxw + c * sxc
    if KMAJOR:
        ih = ih0[None, :] + dh[:, None]
        iw = iw0[None, :] + dw[:, None]
        ptrs = x_pix[None, :] + col_off[:, None]
        mask = mask_m[None, :] & (k < K)[:, None]
    else:
        ih = ih0[:, None] + dh[None, :]
        iw = iw0[:, None] + dw[None, :]
        ptrs = x_pix[:, None] + col_off[None, :]
        mask = mask_m[:, None] & (k < K)[None, :]
    # one unsigned compare per bound pair: a negative index wraps past H (W)
    mask = mask & (ih.to(tl.uint32) < H) & (iw.to(tl.uint32) < W)
    return load_quantized(ptrs, mask, x_inv_scale, x_zp, x_zp_q, FP8, X_QUANTIZED, HAS_X_ZP,
                          EXACT)


@triton.jit(do_not_specialize=["M"])
def _stem_kernel(
    # pointers
    x_ptr, w_ptr, scale_ptr, bias_ptr, x_inv_scale_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    res_scale_ptr, res_zp_ptr, out_inv_scale_ptr, out_zp_ptr, out_ptr,
    # dimensions
    M, H, W, OH, OW, C_OUT,
    # strides (x in elements of [N, C, H, W]; w as [C_OUT, K]; residual and output rows)
    sxn, sxh, sxw, sxc, swo, stride_rm, stride_om,
    # conv geometry
    C: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # prologue and epilogue variants (as ``implicit._qconv_kernel``)
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, HAS_X_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RES_Q: tl.constexpr, HAS_RES_ZP: tl.constexpr,
    POST_ACT: tl.constexpr, OUT_Q: tl.constexpr,
    HAS_OUT_ZP: tl.constexpr, OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr,
    # schedule
    LARGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KMAJOR: tl.constexpr, FP8_PROMOTE: tl.constexpr,
):
    """``out`` [M, C_OUT] rows (channels-last) from ``x`` [N, C, H, W] (any strides) and the
    weight [C_OUT, K], K = (kh, kw, c). ``LARGE``: input offsets past int32 (int64 math)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < C_OUT
    batch, oh, ow = pixel_coords(offs_m, OH, OW)
    ih0 = oh * SH - PH
    iw0 = ow * SW - PW
    if LARGE:
        x_pix = x_ptr + (batch.to(tl.int64) * sxn + ih0 * sxh + iw0 * sxw)
    else:
        x_pix = x_ptr + (batch * sxn + ih0 * sxh + iw0 * sxw)

    x_inv_scale, x_zp, x_zp_q = input_qparams(x_inv_scale_ptr, x_zp_ptr, X_QUANTIZED, HAS_X_ZP)

    K: tl.constexpr = KH * KW * C
    acc_type = tl.float32 if FP8 else tl.int32
    if KMAJOR:  # out^T = W @ patches^T (see _patch_tile)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_type)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    # K is a handful of steps (5 of 32 for 7x7x3): unrolled, each step's (kh, kw, c) columns
    # are compile-time constants and only the pixel terms are computed per element.
    for k0 in tl.static_range(0, K, BLOCK_K):
        a = _patch_tile(x_pix, ih0, iw0, mask_m, k0, H, W, sxh, sxw, sxc,
                        x_inv_scale, x_zp, x_zp_q, C, KW, K, DH, DW, FP8, X_QUANTIZED,
                        HAS_X_ZP, EXACT, BLOCK_K, KMAJOR)
        k = k0 + tl.arange(0, BLOCK_K)
        w_mask = (k < K)[None, :] & mask_n[:, None]
        w = tl.load(w_ptr + offs_n[:, None] * swo + k[None, :], mask=w_mask, other=0.0)
        if KMAJOR:
            acc = dot_acc(w, a, acc, FP8_PROMOTE)
        else:
            acc = dot_acc(a, tl.trans(w), acc, FP8_PROMOTE)
    if KMAJOR:
        acc = tl.trans(acc)

    conv_epilogue(
        acc, offs_m, offs_n, mask_m, mask_n,
        scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, res_scale_ptr, res_zp_ptr,
        out_inv_scale_ptr, out_zp_ptr, out_ptr, stride_rm, stride_om,
        HAS_X_ZP, HAS_BIAS, ACT, HAS_RESIDUAL, RES_Q, HAS_RES_ZP, POST_ACT, OUT_Q, HAS_OUT_ZP,
        OUT_MANT, OUT_EMIN, EXACT,
    )


def stem_conv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, operands: tuple,
              flags: dict, config: StemConfig, launch=None) -> torch.Tensor:
    """Launch ``_stem_kernel`` for ``implicit.qconv2d``: ``x`` [N, C, H, W] (any strides; float,
    or int8/fp8 when ``flags["X_QUANTIZED"]``), ``weight`` [O, C, KH, KW] (``pack_weight``'s
    layout: K contiguous) into ``out``, the channels-last [N, O, OH, OW] tensor ``qconv2d``
    allocated. ``operands``: the kernel's tensors between weight and output, in its order
    (scale, bias, x_inv_scale, x_zero_point, wsum, residual, residual_scale,
    residual_zero_point, out_inv_scale, out_zero_point; absent ones a never-read dummy);
    ``flags``: the constexprs ``qconv2d`` builds for every conv kernel; ``launch`` wraps the
    kernel before its launch."""
    launch = launch or (lambda k: k)
    n, c, h, w = x.shape
    c_out, _, kh, kw = weight.shape
    oh, ow = out.shape[2], out.shape[3]
    M = n * oh * ow
    w2 = weight.permute(0, 2, 3, 1).reshape(c_out, kh * kw * c)  # a view of a packed weight
    if w2.stride(1) != 1:
        w2 = w2.contiguous()
    sx = x.stride()
    # the largest offset a (masked or not) pointer of the tile can form, padding taps included
    span = sum(abs(s) * (d + 2 * kh + 2 * kw) for s, d in zip(sx, x.shape, strict=True))
    cfg = config
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(c_out, cfg.block_n))
    launch(_stem_kernel)[grid](
        x, w2, *operands, out,
        M, h, w, oh, ow, c_out,
        sx[0], sx[2], sx[3], sx[1], w2.stride(0), c_out, c_out,
        C=c, **flags,
        LARGE=span >= 2**31, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        KMAJOR=cfg.kmajor, FP8_PROMOTE=cfg.fp8_promote if flags["FP8"] else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return out
