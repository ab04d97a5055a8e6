"""The fused quantized GEMM with Hopper's tensor memory accelerator (TMA): x and W tiles are
loaded through host-side tensor descriptors, the epilogue is ``epilogue.finish_tile``'s.

    acc[M, N] = x_q @ W_q^T                        (int8: int32 accumulate; fp8: float32)
    out       = finish_tile(acc)                   (scales, bias, act / gated, residual, requant)

Same arguments and numbers as ``mma_gemm._qlinear_kernel`` for an already quantized x (int8/fp8,
handed over by the previous layer or quantized by a separate pass: a descriptor reads memory as
it is, so there is no prologue quantization here). A descriptor load is one bulk copy issued by
one thread into swizzled shared memory, with edges past M, N and K zero-filled by the copy
engine: no address arithmetic or masks in the main loop, and the registers they took are free
for the accumulator and the epilogue. Grid: one program per tile, or (``persistent``) one per SM
walking the tiles in grouped order with the loop flattened, so the next tile's first loads are in
flight while this tile's epilogue runs. (A warp-specialized tile loop, which would overlap a heavy
epilogue with the next tile's MMAs, does not compile for this kernel on sm_90: triton 3.7.1's
make_ttgir fails, triton 3.6 did not finish within 180 s on an H200.)

What a descriptor needs, checked by ``supported``: a 16-byte aligned base, unit stride along K
and a row pitch that is a multiple of 16 bytes (K % 16 == 0 for one-byte elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qfuse.kernels.common import pdl_wait, tile_indices
from qfuse.kernels.epilogue import finish_tile, start_acc
from qfuse.kernels.grid import pdl


@triton.jit(do_not_specialize=["M"])
def _qlinear_tma_kernel(
    # descriptors (x [M, K], W [N, K]) and epilogue pointers
    x_desc, w_desc, scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr,
    out_inv_scale_ptr, out_zp_ptr, out_ptr,
    # dimensions
    M, N, K,
    # strides of the residual and the output
    stride_rm, stride_rn, stride_om, stride_on,
    # meta-parameters: numerics
    FP8: tl.constexpr,
    X_ROW_SCALE: tl.constexpr,
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
    EPI_SPLIT: tl.constexpr,
    FLATTEN: tl.constexpr,
    # launched as a programmatic dependent launch (``grid.pdl``): x is the previous kernel's
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_indices(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        offs_n = col0 + tl.arange(0, BLOCK_N)
        acc = start_acc(offs_n, N, x_zp_ptr, wsum_ptr, True, FP8, ZP_CORR, BLOCK_M, BLOCK_N)
        for k in range(0, k_tiles):
            a = x_desc.load([row0, k * BLOCK_K])
            b = w_desc.load([col0, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc, out_dtype=acc.dtype)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        finish_tile(
            acc, offs_m, pid_n, M, N,
            scale_ptr, x_scale_ptr, bias_ptr, x_zp_ptr, wsum_ptr, res_ptr, out_inv_scale_ptr,
            out_zp_ptr, out_ptr,
            stride_rm, stride_rn, stride_om, stride_on,
            X_ROW_SCALE, False, HAS_BIAS, ACT, HAS_RESIDUAL, OUT_Q, HAS_OUT_ZP,
            OUT_MANT, OUT_EMIN, EXACT, FAST_ACT, BLOCK_N, EPI_SPLIT,
        )


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether descriptors can read ``x`` [M, K] and ``weight`` [N, K] as they are."""
    K = x.shape[1]
    return all(
        t.dtype in (torch.int8, torch.float8_e4m3fn)
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        for t in (x, weight)
    ) and K % 16 == 0


def descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int,
                block_k: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    return (TensorDescriptor.from_tensor(x, [block_m, block_k]),
            TensorDescriptor.from_tensor(weight, [block_n, block_k]))


def tma_args(ptr_args: dict, x: torch.Tensor, weight: torch.Tensor, cfg) -> dict:
    """``_qlinear_tma_kernel``'s arguments by name, from ``qgemm.gemm_args``' pointer kernel
    arguments of the same call (every epilogue argument is the same; x and W become
    descriptors, and the prologue's and split-K's arguments go)."""
    x_desc, w_desc = descriptors(x, weight, cfg.block_m, cfg.block_n, cfg.block_k)
    a = ptr_args
    return dict(
        x_desc=x_desc, w_desc=w_desc, scale_ptr=a["scale_ptr"], x_scale_ptr=a["x_scale_ptr"],
        bias_ptr=a["bias_ptr"], x_zp_ptr=a["x_zp_ptr"], wsum_ptr=a["wsum_ptr"],
        res_ptr=a["res_ptr"], out_inv_scale_ptr=a["out_inv_scale_ptr"],
        out_zp_ptr=a["out_zp_ptr"], out_ptr=a["out_ptr"],
        M=a["M"], N=a["N"], K=a["K"],
        stride_rm=a["stride_rm"], stride_rn=a["stride_rn"], stride_om=a["stride_om"],
        stride_on=a["stride_on"],
        FP8=a["FP8"], X_ROW_SCALE=a["X_ROW_SCALE"], ZP_CORR=a["ZP_CORR"],
        HAS_BIAS=a["HAS_BIAS"], ACT=a["ACT"], HAS_RESIDUAL=a["HAS_RESIDUAL"],
        OUT_Q=a["OUT_Q"], HAS_OUT_ZP=a["HAS_OUT_ZP"], OUT_MANT=a["OUT_MANT"],
        OUT_EMIN=a["OUT_EMIN"], EXACT=a["EXACT"], FAST_ACT=a["FAST_ACT"],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EPI_SPLIT=cfg.epi_split, FLATTEN=cfg.persistent, PDL=pdl(x.device),
    )

