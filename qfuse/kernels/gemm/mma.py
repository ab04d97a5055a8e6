"""The MMA family: the fused quantized GEMM on tensor cores with pointer loads, one program per
output tile (optionally split along K) or one per SM walking the tiles (persistent).

    acc[M, N] = x_q @ W_q^T                 (int8: int32 accumulate; fp8: float32)
    out       = finish_tile(acc)             (``epilogue``: scales, bias, act, residual, requant)

x is float (quantized in the prologue with a static per-tensor or per-input-channel scale: no
extra pass over HBM), or already quantized. Small M is memory-bound on W, so there the tile grid
is split along K (``SPLIT_K``) until it fills the GPU; partial accumulators go to a workspace and
the last program of each tile (an atomic counter) reduces them in a fixed order and runs the
epilogue, so results stay deterministic and int8 outputs stay bit-exact. Launched by ``qgemm``
(arguments: ``qgemm.gemm_args``); registered in ``families``.
"""

import triton
import triton.language as tl

from qfuse.kernels.common import quantize_fp8, quantize_int8, tile_indices
from qfuse.kernels.epilogue import finish_tile, split_k_reduce, start_acc


@triton.jit(do_not_specialize=["M"])
def _qlinear_kernel(
    # pointers
    x_ptr, w_ptr, scale_ptr, x_scale_ptr, bias_ptr, x_inv_scale_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    out_inv_scale_ptr, out_zp_ptr, out_ptr, ws_ptr, lock_ptr,
    # dimensions
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    # meta-parameters: numerics
    FP8: tl.constexpr,
    X_QUANTIZED: tl.constexpr,
    X_INV_VEC: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
    HAS_X_ZP: tl.constexpr,
    ZP_CORR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_Q: tl.constexpr,
    HAS_OUT_ZP: tl.constexpr,
    OUT_MANT: tl.constexpr,
    OUT_EMIN: tl.constexpr,
    EXACT: tl.constexpr,
    FAST_ACT: tl.constexpr,
    # meta-parameters: schedule
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = tile_indices(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # This program's K range: all of K, or its share of the K tiles under split-K.
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = 0
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        k_first = tl.program_id(1) * per_split
        k_tiles = tl.minimum(k_tiles, k_first + per_split)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_first * BLOCK_K + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + (k_first * BLOCK_K + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn

    if not X_QUANTIZED:
        if not X_INV_VEC:
            x_inv_scale = tl.load(x_inv_scale_ptr)
        x_zp = 0.0
        if HAS_X_ZP:
            x_zp = tl.load(x_zp_ptr).to(tl.float32)

    # ---- main loop: int8 / fp8 tensor-core MMA ----
    acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, k_first == 0, FP8, ZP_CORR, BLOCK_M, BLOCK_N)
    for k in range(k_first, k_tiles):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if not X_QUANTIZED:
            if X_INV_VEC:  # per-input-channel (SmoothQuant prologue) inverse scales
                inv_ptrs = x_inv_scale_ptr + k * BLOCK_K + offs_k
                x_inv_scale = tl.load(inv_ptrs, mask=offs_k < k_left, other=0.0)[None, :]
            if FP8:
                a = quantize_fp8(a.to(tl.float32), x_inv_scale, EXACT)
            else:
                a = quantize_int8(a.to(tl.float32), x_inv_scale, x_zp)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ---- split-K: park the partial sum; the tile's last program reduces and goes on ----
    is_last = True
    if SPLIT_K > 1:
        acc, is_last = split_k_reduce(acc, offs_m, offs_n, M, N, ws_ptr, lock_ptr + pid, SPLIT_K)
    if is_last:
        finish_tile(
            acc, offs_m, pid_n, M, N,
            scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, out_inv_scale_ptr,
            out_zp_ptr, out_ptr,
            stride_rm, stride_rn, stride_om, stride_on,
            X_ROW_SCALE, False, HAS_BIAS, ACT, HAS_RESIDUAL, OUT_Q, HAS_OUT_ZP,
            OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, EPI_SPLIT,
        )


@triton.jit(do_not_specialize=["M"])
def _qlinear_persistent_kernel(
    x_ptr, w_ptr, scale_ptr, x_scale_ptr, bias_ptr, x_inv_scale_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    out_inv_scale_ptr, out_zp_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    FP8: tl.constexpr, X_QUANTIZED: tl.constexpr, X_INV_VEC: tl.constexpr,
    X_ROW_SCALE: tl.constexpr, HAS_X_ZP: tl.constexpr, ZP_CORR: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, OUT_Q: tl.constexpr, HAS_OUT_ZP: tl.constexpr,
    OUT_MANT: tl.constexpr, OUT_EMIN: tl.constexpr, EXACT: tl.constexpr, FAST_ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, EPI_SPLIT: tl.constexpr,
):
    """``_qlinear_kernel`` (same arguments, same numbers; no split-K) as a persistent kernel:
    one program per SM walks the output tiles, and the flattened loop lets the software
    pipeliner issue the next tile's first loads while this tile's epilogue runs. Short K loops
    (encoder GEMMs: K = 384..768 is 3..6 tiles of 128) otherwise spend a pipeline fill and
    drain per tile with the tensor cores idle."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    if not X_QUANTIZED:
        if not X_INV_VEC:
            x_inv_scale = tl.load(x_inv_scale_ptr)
        x_zp = 0.0
        if HAS_X_ZP:
            x_zp = tl.load(x_zp_ptr).to(tl.float32)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = tile_indices(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows/columns past the edge read row/column 0 instead of being masked (only K is):
        # unmasked loads pipeline better, and the epilogue's store mask drops them.
        rows = tl.where(offs_m < M, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, True, FP8, ZP_CORR, BLOCK_M, BLOCK_N)
        for k in range(0, k_tiles):
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            if not X_QUANTIZED:
                if X_INV_VEC:
                    inv_ptrs = x_inv_scale_ptr + k * BLOCK_K + offs_k
                    x_inv_scale = tl.load(inv_ptrs, mask=offs_k < k_left, other=0.0)[None, :]
                if FP8:
                    a = quantize_fp8(a.to(tl.float32), x_inv_scale, EXACT)
                else:
                    a = quantize_int8(a.to(tl.float32), x_inv_scale, x_zp)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        finish_tile(
            acc, offs_m, pid_n, M, N,
            scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, out_inv_scale_ptr,
            out_zp_ptr, out_ptr,
            stride_rm, stride_rn, stride_om, stride_on,
            X_ROW_SCALE, False, HAS_BIAS, ACT, HAS_RESIDUAL, OUT_Q, HAS_OUT_ZP,
            OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, EPI_SPLIT,
        )
