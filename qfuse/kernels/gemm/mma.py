"""The MMA family's main loop: tensor-core MMAs over tiles loaded through pointers, x quantized in
the prologue when it comes float. ``kernel._qlinear_kernel`` runs it per output tile (the
``mma`` schedules, optionally split along K) or per tile walked by one program per SM
(``persistent``); ``families`` registers both."""

import triton
import triton.language as tl

from qfuse.kernels.common import quantize_tile


@triton.jit
def mma_accumulate(
    acc, x_ptr, w_ptr, x_inv_scale_ptr, x_inv_scale, x_zp, rows, cols, M, N, K, k_first, k_end,
    stride_xm, stride_xk, stride_wn, stride_wk,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, X_INV_VEC: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_K: tl.constexpr, MASK_MN: tl.constexpr,
):
    """``acc`` plus ``x[rows] @ W[cols]^T`` over K tiles ``k_first..k_end``, a float x quantized
    with ``x_inv_scale`` and ``x_zp`` (``common.input_qparams``) or per-channel inverse scales.
    ``MASK_MN``: rows and columns past M and N are masked; otherwise the caller pointed them at
    row/column 0 (unmasked loads pipeline better; the epilogue's store mask drops them)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_first * BLOCK_K + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + (k_first * BLOCK_K + offs_k)[:, None] * stride_wk + cols[None, :] * stride_wn
    mask_m = rows < M
    mask_n = cols < N
    for k in range(k_first, k_end):
        k_left = K - k * BLOCK_K
        if MASK_MN:
            a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        else:
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        if not X_QUANTIZED:
            a = quantize_tile(a, x_inv_scale_ptr + k * BLOCK_K + offs_k, offs_k < k_left,
                              x_inv_scale, x_zp, FP8, X_INV_VEC, EXACT)
        if MASK_MN:
            b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        else:
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


def mma_args(args: dict, x, weight, cfg) -> dict:
    """``launch.gemm_args``' arguments with the tile schedules' flags."""
    return {**args, "PERSISTENT": cfg.persistent, "TMA": False, "DECODE": False, "WORDS": False,
            "EVEN_K": False, "X_WORDS": False, "PDL": False}
