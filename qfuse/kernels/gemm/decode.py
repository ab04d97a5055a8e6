"""The decode (weight-streaming) schedule of the fused quantized GEMM: no tensor cores, many
small programs, each streaming a few weight rows with 16-byte loads. Its main loop
(``decode_accumulate``) runs in ``mma._qlinear_kernel`` under ``DECODE``, which ends in the
other schedules' epilogue (``epilogue.finish_tile``).

    acc[m, n] = sum_k x_q[m, k] * W_q[n, k]        (int8: int32, exact; fp8: float32)

At decode sizes (M = 1..32 tokens) a quantized GEMM is a weight stream (TinyLlama's o_proj is
4 MB of int8). The MMA schedule pads M to a 16-row MMA and fills the GPU by split-K over
64..256-column tiles: 32..160 programs, each streaming its tile through a pipeline, well short of
the memory bandwidth over a decode step. Here a program owns ``BLOCK_N`` whole weight rows
(4..16) and ``BLOCK_K`` columns per step, so a 2048-row weight gives 128..512 column blocks, and
split-K (``schedules.decode_candidates``) brings the grid to ~8 programs per SM, each with its
few steps' loads in flight; W is read in its stored [N, K] layout (K contiguous: 16-byte vector
loads), and the next step's weights are loaded before this step's products. Without split-K
(gate+up: 1408 column blocks of 8) each program reduces its rows over all of K: no workspace, no
second pass. With it, the tile's last program sums the [BLOCK_M, BLOCK_N] partials in a fixed
order (``epilogue.split_k_reduce``): a few hundred bytes, no second launch.

Products are plain vector math, accumulated lane-wise in ``acc3`` [BLOCK_M, BLOCK_N, lanes] and
summed once after the K loop. int8 with K % 4 == 0 ("words"): W is read as int32 words of four
int8 and multiplied by ``dp4a`` (4 multiply-adds in one instruction: at M = 8 the byte-wise
form would need 8 integer multiply-adds per weight byte, more than an SM issues at HBM rate).
fp8 (and int8 with other K): each byte converted to float32/int32 and multiplied. Integer sums
are exact in any order, so int8 outputs stay bit-identical to the CPU reference; fp8 sums in a
fixed order per schedule (deterministic), within float32 rounding of the reference.

Offered by ``tuning`` (``GemmConfig.decode``) for the 1- and 2-row buckets, where it beat the
best MMA schedule on an H100 for int8 at M = 1 (it lost at M = 8 and 32); launched with the
other schedules' arguments (plus the ``WORDS``, ``EVEN_K`` and ``X_WORDS`` constexprs, set by
``decode_args``), so the eager cached launch and ``wrap_triton`` take it unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import INTERPRETED_JIT, pdl_wait, quantize_int8, quantize_tile
from qfuse.kernels.grid import pdl


@triton.jit
def dp4a(a, b, c):
    """``c + sum_j a.byte[j] * b.byte[j]`` over the four signed int8 packed in int32 ``a``, ``b``.

    On the GPU one ``dp4a.s32.s32``; in the interpreter (no inline PTX) the same sum from
    sign-extended bytes: shifting byte j to the top and arithmetically back extends its sign.
    """
    if INTERPRETED_JIT:
        s = c
        for j in tl.static_range(4):
            s += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return s
    else:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )


@triton.jit
def _x_words(x_ptr, x_inv_scale_ptr, offs_m, mask_m, kw, K, stride_xm, stride_xk, x_inv_scale,
             x_zp, X_QUANTIZED: tl.constexpr, X_INV_VEC: tl.constexpr, X_WORDS: tl.constexpr):
    """x[offs_m, 4 kw + j] (j = 0..3) as int8 packed little-endian into int32 words [BM, BKW].

    ``X_WORDS`` (int8 x, rows 4-byte aligned): read as words, one vector load. Otherwise four
    strided loads, quantized first when x is float: x is M x K (a few KB, L1-resident after the
    first program), the weights are what must stream. Every program quantizes the x columns it
    needs, ~13 operations an element against one dp4a per four weight bytes per row it shares
    them with: hence the ``prequantize`` decode candidates (one small pass, then words)."""
    if X_WORDS:
        rows = (x_ptr + tl.where(mask_m, offs_m, 0) * stride_xm).to(tl.pointer_type(tl.int32))
        return tl.load(rows[:, None] + kw[None, :], mask=(kw < K // 4)[None, :], other=0)
    word = tl.zeros((offs_m.shape[0], kw.shape[0]), dtype=tl.int32)
    for j in tl.static_range(4):
        k = kw * 4 + j
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        if not X_QUANTIZED:
            if X_INV_VEC:
                inv = tl.load(x_inv_scale_ptr + k, mask=k < K, other=0.0)[None, :]
                a = quantize_int8(a.to(tl.float32), inv, x_zp)
            else:
                a = quantize_int8(a.to(tl.float32), x_inv_scale, x_zp)
        word = word | ((a.to(tl.int32) & 0xFF) << (8 * j))
    return word


@triton.jit
def _x_tile(x_ptr, x_inv_scale_ptr, offs_m, mask_m, k, K, stride_xm, stride_xk, x_inv_scale,
            x_zp, FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, X_INV_VEC: tl.constexpr,
            EXACT: tl.constexpr):
    """x[offs_m, k] quantized (when float) and widened: float32 (fp8) or int32 (int8)."""
    mask_k = k < K
    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    if not X_QUANTIZED:
        a = quantize_tile(a, x_inv_scale_ptr + k, mask_k, x_inv_scale, x_zp, FP8, X_INV_VEC,
                          EXACT)
    if FP8:
        a = a.to(tl.float32)
    else:
        a = a.to(tl.int32)
    return a


@triton.jit
def _w_step(w_ptrs, step, k_end, offs, limit, STEP: tl.constexpr, EVEN_K: tl.constexpr,
            ZERO: tl.constexpr):
    """The weights of K step ``step`` (``ZERO`` from ``k_end`` on): columns ``offs`` of the
    step, those from ``limit - step * STEP`` on masked too unless every step is whole
    (``EVEN_K``)."""
    if EVEN_K:
        return tl.load(w_ptrs, mask=step < k_end, other=ZERO)
    else:
        return tl.load(w_ptrs, mask=(step < k_end) & (offs < limit - step * STEP)[None, :],
                       other=ZERO)


@triton.jit
def decode_accumulate(
    x_ptr, w_ptr, x_inv_scale_ptr, x_inv_scale, x_zp, offs_m, mask_m, cols, K, k_first, k_end,
    stride_xm, stride_xk, stride_wn, stride_wk,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, X_INV_VEC: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_K: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr, X_WORDS: tl.constexpr,
    PDL: tl.constexpr,
):
    """acc [BM, BN] = x_q[offs_m, K-steps k_first..k_end) @ W[cols, same]^T, x quantized with
    ``x_inv_scale`` and ``x_zp`` (``common.input_qparams``) when float.

    ``cols`` are in-range row indices of W (the caller clamps past-the-edge ones), so only the
    K tail is masked, and not at all when ``EVEN_K``. Each step's weights are loaded one step
    ahead (``w_next``), so a program keeps a load in flight while it multiplies.

    ``PDL`` (launched as a programmatic dependent launch): the first step's weights are loaded
    before ``gdc_wait``, which holds the program until the kernel before it has finished and
    its writes are visible. Everything after it (x, scales, the residual, every store) may
    depend on that kernel; the weights do not, so their first loads overlap its tail.
    """
    if WORDS:
        BKW: tl.constexpr = BLOCK_K // 4
        offs_kw = tl.arange(0, BKW)
        # Row starts in bytes first (stride_wn is specialized as a multiple of 16, so the
        # compiler knows each row is 16-byte aligned), then words: v4 loads, not 4 scalar ones.
        rows = w_ptr + cols * stride_wn + k_first * BLOCK_K
        w_ptrs = rows.to(tl.pointer_type(tl.int32))[:, None] + offs_kw[None, :]
        acc3 = tl.zeros((offs_m.shape[0], cols.shape[0], BKW), dtype=tl.int32)
        w_next = _w_step(w_ptrs, k_first, k_end, offs_kw, K // 4, BKW, EVEN_K, 0)
        pdl_wait(PDL)
        for k in range(k_first, k_end):
            w = w_next
            w_ptrs += BKW
            w_next = _w_step(w_ptrs, k + 1, k_end, offs_kw, K // 4, BKW, EVEN_K, 0)
            xw = _x_words(x_ptr, x_inv_scale_ptr, offs_m, mask_m, k * BKW + offs_kw, K,
                          stride_xm, stride_xk, x_inv_scale, x_zp, X_QUANTIZED, X_INV_VEC,
                          X_WORDS)
            acc3 = dp4a(tl.broadcast_to(xw[:, None, :], acc3.shape),
                        tl.broadcast_to(w[None, :, :], acc3.shape), acc3)
        return tl.sum(acc3, axis=2)
    else:
        # One row: accumulate lane-wise, sum once at the end. Several rows: a lane accumulator
        # per row would hold BLOCK_M x as many registers (fp8, 8 rows x 8 x 256: 128 a thread),
        # so each step's products are summed over K at once (in-thread adds, then a few
        # shuffles), in a fixed order as well.
        LANES: tl.constexpr = offs_m.shape[0] == 1
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = (w_ptr + cols[:, None] * stride_wn
                  + (k_first * BLOCK_K + offs_k)[None, :] * stride_wk)
        acc_dtype = tl.float32 if FP8 else tl.int32
        acc = tl.zeros((offs_m.shape[0], cols.shape[0]), dtype=acc_dtype)
        if LANES:
            acc3 = tl.zeros((1, cols.shape[0], BLOCK_K), dtype=acc_dtype)
        w_next = _w_step(w_ptrs, k_first, k_end, offs_k, K, BLOCK_K, EVEN_K, 0.0)
        pdl_wait(PDL)
        for k in range(k_first, k_end):
            w = w_next
            w_ptrs += BLOCK_K * stride_wk
            w_next = _w_step(w_ptrs, k + 1, k_end, offs_k, K, BLOCK_K, EVEN_K, 0.0)
            a = _x_tile(x_ptr, x_inv_scale_ptr, offs_m, mask_m, k * BLOCK_K + offs_k, K,
                        stride_xm, stride_xk, x_inv_scale, x_zp, FP8, X_QUANTIZED, X_INV_VEC,
                        EXACT)
            if FP8:
                prod = a[:, None, :] * w.to(tl.float32)[None, :, :]
            else:
                prod = a[:, None, :] * w.to(tl.int32)[None, :, :]
            if LANES:
                acc3 += prod
            else:
                acc += tl.sum(prod, axis=2)
        if LANES:
            acc = tl.sum(acc3, axis=2)
        return acc


def words(t: torch.Tensor) -> bool:
    """Whether the decode kernel may read int8 ``t`` (W [N, K] or x [M, K]) as int32 words:
    K-contiguous rows of a multiple of 4 bytes, starting 4-byte aligned (the storage itself
    is). The eager plans launch only on contiguous, 16-byte aligned x, so this holds for them
    whenever it held when they were built."""
    return (t.dtype == torch.int8 and t.stride(1) == 1 and t.shape[1] % 4 == 0
            and t.stride(0) % 4 == 0 and t.storage_offset() % 4 == 0)


def decode_args(args: dict, x: torch.Tensor, weight: torch.Tensor, cfg) -> dict:
    """``launch.gemm_args``' arguments with the decode schedule's flags: whether W (and x) are
    read as int32 words, whether K is a whole number of blocks, and whether it is launched as a
    programmatic dependent launch (``grid.pdl``)."""
    w_words = words(weight)
    return {**args, "PERSISTENT": False, "TMA": False, "DECODE": True, "WORDS": w_words,
            "EVEN_K": args["K"] % cfg.block_k == 0, "X_WORDS": w_words and words(x),
            "PDL": pdl(x.device)}

