"""The fused quantized GEMM kernel: one ``@triton.jit`` function whose schedules are constexpr
flags, each family's main loop in its own module, one epilogue for all.

    acc[M, N] = x_q @ W_q^T                 (int8: int32 accumulate; fp8: float32)
    out       = finish_tile(acc)             (``epilogue``: scales, bias, act, residual, requant)

- tiles (``mma``): one program per output tile, tensor-core MMAs over pointer loads
  (``mma.mma_accumulate``), optionally split along K;
- ``PERSISTENT``: the same tiles walked by one program per SM;
- ``DECODE``: weight streaming for a few rows without tensor cores (``decode``);
- ``TMA``: x and W tiles loaded through host-side tensor descriptors (``tma``; ``x_ptr`` and
  ``w_ptr`` are then the descriptors), one tile per program or persistent.

x is float (quantized in the prologue with a static per-tensor or per-input-channel scale: no
extra pass over HBM), or already quantized (TMA: always). Small M is memory-bound on W, so there
the tile grid is split along K (``SPLIT_K``) until it fills the GPU; partial accumulators go to
a workspace and the last program of each tile (an atomic counter) reduces them in a fixed order
and runs the epilogue, so results stay deterministic and int8 outputs stay bit-exact. Launched
by ``launch`` (arguments: ``launch.gemm_args``, bound per family by ``families``).
"""

import triton
import triton.language as tl

from qfuse.kernels.common import input_qparams, pdl_wait, tile_indices, tile_offsets
from qfuse.kernels.epilogue import finish_tile, k_range, split_k_reduce, start_acc
from qfuse.kernels.gemm.decode import decode_accumulate
from qfuse.kernels.gemm.mma import mma_accumulate
from qfuse.kernels.gemm.tma import tma_accumulate


@triton.jit(do_not_specialize=["M"])
def _qlinear_kernel(
    # pointers (TMA: x_ptr and w_ptr are tensor descriptors)
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
    PERSISTENT: tl.constexpr,
    TMA: tl.constexpr,
    DECODE: tl.constexpr,
    # decode only: W (and int8 x) read as int32 words of 4 int8 (dp4a); K a multiple of BLOCK_K
    WORDS: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_WORDS: tl.constexpr,
    # decode and TMA: launched as a programmatic dependent launch (``grid.pdl``)
    PDL: tl.constexpr,
):
    """Program ``(pid, s)`` computes output tile ``pid`` (grouped order) over the ``s``-th of
    ``SPLIT_K`` K ranges.

    ``PERSISTENT`` (no split-K): one program per SM walks the output tiles, and the flattened
    loop lets the software pipeliner issue the next tile's first loads while this tile's
    epilogue runs. Short K loops (encoder GEMMs: K = 384..768 is 3..6 tiles of 128) otherwise
    spend a pipeline fill and drain per tile with the tensor cores idle. ``TMA`` walks the
    tiles the same way, one per program unless ``PERSISTENT``.

    ``DECODE``: rows ``BLOCK_M`` x columns ``BLOCK_N`` per program without tensor cores; the row
    blocks of one column block are neighbours in launch order, so a weight slice read by one is
    in L2 for the next. ``GROUP_M`` and ``EPI_SPLIT`` are unused (one small tile, one
    epilogue), and the zero-point correction is the epilogue's."""
    if TMA:
        pdl_wait(PDL)  # x is the previous kernel's
    pid = tl.program_id(0)
    X_ZP: tl.constexpr = HAS_X_ZP and not X_QUANTIZED  # the prologue's zero point
    x_inv_scale, x_zp, _ = input_qparams(x_inv_scale_ptr, x_zp_ptr, X_QUANTIZED, X_ZP, X_INV_VEC)
    if PERSISTENT or TMA:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(pid, tiles, tl.num_programs(0), flatten=PERSISTENT):
            pid_m, pid_n = tile_indices(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            if TMA:
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, True, FP8, ZP_CORR, BLOCK_M,
                                BLOCK_N)
                acc = tma_accumulate(acc, x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N,
                                     k_tiles, BLOCK_K)
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            else:
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                # Rows/columns past the edge read row/column 0 instead of being masked (only K
                # is): unmasked loads pipeline better, and the epilogue's store mask drops them.
                acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, True, FP8, ZP_CORR, BLOCK_M,
                                BLOCK_N)
                acc = mma_accumulate(
                    acc, x_ptr, w_ptr, x_inv_scale_ptr, x_inv_scale, x_zp,
                    tl.where(offs_m < M, offs_m, 0), tl.where(offs_n < N, offs_n, 0), M, N, K,
                    0, k_tiles, stride_xm, stride_xk, stride_wn, stride_wk,
                    FP8, X_QUANTIZED, X_INV_VEC, EXACT, BLOCK_K, False,
                )
            finish_tile(
                acc, offs_m, pid_n, M, N,
                scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr,
                out_inv_scale_ptr, out_zp_ptr, out_ptr,
                stride_rm, stride_rn, stride_om, stride_on,
                X_ROW_SCALE, False, HAS_BIAS, ACT, HAS_RESIDUAL, OUT_Q, HAS_OUT_ZP,
                OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, EPI_SPLIT,
            )
    else:
        if DECODE:
            num_m = tl.cdiv(M, BLOCK_M)
            pid_n = pid // num_m
            offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        else:
            offs_m, offs_n, _, pid_n = tile_offsets(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_first, k_end = k_range(K, BLOCK_K, SPLIT_K)
        if DECODE:
            # Columns past N read row 0 of W instead (the store mask drops them): unmasked rows.
            acc = decode_accumulate(
                x_ptr, w_ptr, x_inv_scale_ptr, x_inv_scale, x_zp, offs_m, offs_m < M,
                tl.where(offs_n < N, offs_n, 0), K, k_first, k_end,
                stride_xm, stride_xk, stride_wn, stride_wk,
                FP8, X_QUANTIZED, X_INV_VEC, EXACT, BLOCK_K, WORDS, EVEN_K, X_WORDS, PDL,
            )
        else:
            acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, k_first == 0, FP8, ZP_CORR, BLOCK_M,
                            BLOCK_N)
            acc = mma_accumulate(
                acc, x_ptr, w_ptr, x_inv_scale_ptr, x_inv_scale, x_zp, offs_m, offs_n, M, N, K,
                k_first, k_end, stride_xm, stride_xk, stride_wn, stride_wk,
                FP8, X_QUANTIZED, X_INV_VEC, EXACT, BLOCK_K, True,
            )
        # ---- split-K: park the partial sum; the tile's last program reduces and goes on ----
        is_last = True
        if SPLIT_K > 1:
            acc, is_last = split_k_reduce(acc, offs_m, offs_n, M, N, ws_ptr, lock_ptr + pid,
                                          SPLIT_K)
        if is_last:
            EPI_ZP: tl.constexpr = DECODE and ZP_CORR  # decode corrects in the epilogue
            EPI_PARTS: tl.constexpr = 1 if DECODE else EPI_SPLIT
            finish_tile(
                acc, offs_m, pid_n, M, N,
                scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr,
                out_inv_scale_ptr, out_zp_ptr, out_ptr,
                stride_rm, stride_rn, stride_om, stride_on,
                X_ROW_SCALE, EPI_ZP, HAS_BIAS, ACT, HAS_RESIDUAL, OUT_Q, HAS_OUT_ZP,
                OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, EPI_PARTS,
            )
