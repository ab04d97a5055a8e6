"""Fused quantized GEMM: int8 x int8 -> int32 with the whole epilogue in registers.

    out[M, N] = requant?( (+ residual)( act( (x_q @ W_q^T - zp_x * colsum(W)) * scale[n] + bias[n] ) ) )

x is either float (quantized in the prologue with a static per-tensor scale: one fewer pass over
HBM than a separate quantize kernel) or already int8 (handed over by the previous fused layer).
W is [N, K] int8 with one float32 scale per output channel, folded with the activation scale into
``scale[n] = s_x * s_w[n]`` at convert time. The output is int8 (requantized with the next
layer's scale) or float (the dtype of ``out``).
"""

import os

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import (
    ACTIVATION_CODES,
    activation,
    quantize_int8,
    tile_indices,
)

# The @triton.jit decorator reads TRITON_INTERPRET when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _qlinear_kernel(
    # pointers
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    x_inv_scale_ptr,
    x_zp_ptr,
    wsum_ptr,
    res_ptr,
    out_inv_scale_ptr,
    out_zp_ptr,
    out_ptr,
    # dimensions
    M,
    N,
    K,
    # strides
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_rm,
    stride_rn,
    stride_om,
    stride_on,
    # meta-parameters
    X_QUANTIZED: tl.constexpr,
    HAS_X_ZP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    OUT_INT8: tl.constexpr,
    HAS_OUT_ZP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = tile_indices(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn

    x_zp = 0.0
    if HAS_X_ZP:
        x_zp = tl.load(x_zp_ptr).to(tl.float32)
    if not X_QUANTIZED:
        x_inv_scale = tl.load(x_inv_scale_ptr)

    # ---- main loop: int8 tensor-core MMA, int32 accumulator ----
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0)
        if not X_QUANTIZED:
            a = quantize_int8(a.to(tl.float32), x_inv_scale, x_zp)
        b = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # ---- epilogue: zero-point correction, scales, bias, activation, residual, requant ----
    if HAS_X_ZP:
        wsum = tl.load(wsum_ptr + offs_n, mask=mask_n, other=0)
        acc = acc - x_zp.to(tl.int32) * wsum[None, :]
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        y = y + bias[None, :]
    y = activation(y, ACT)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        y = y + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if OUT_INT8:
        out_zp = 0.0
        if HAS_OUT_ZP:
            out_zp = tl.load(out_zp_ptr).to(tl.float32)
        tl.store(out_ptrs, quantize_int8(y, tl.load(out_inv_scale_ptr), out_zp), mask=mask)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _pick_config(M: int, K: int, x_bytes: int) -> dict:
    """Block shapes by M bucket (the interpreter wants few, large programs)."""
    if INTERPRETED:
        block_m = max(16, min(64, triton.next_power_of_2(M)))
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=1)
    # A float x tile costs x_bytes per element in shared memory: keep a stage under ~48 KB.
    block_k = 128 if x_bytes == 1 else 64
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8, num_stages=3)


def qlinear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    act: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Launch ``_qlinear_kernel`` on 2-D ``x`` [M, K] and ``weight`` [N, K]; returns [M, N]."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return out
    cfg = _pick_config(M, K, x.element_size())
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    res = residual if residual is not None else out
    dummy = scale
    _qlinear_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else dummy,
        x_inv_scale if x_inv_scale is not None else dummy,
        x_zero_point if x_zero_point is not None else dummy,
        weight_sum if weight_sum is not None else dummy,
        res,
        out_inv_scale if out_inv_scale is not None else dummy,
        out_zero_point if out_zero_point is not None else dummy,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        res.stride(0),
        res.stride(1),
        out.stride(0),
        out.stride(1),
        X_QUANTIZED=x.dtype == torch.int8,
        HAS_X_ZP=x_zero_point is not None,
        HAS_BIAS=bias is not None,
        ACT=ACTIVATION_CODES[act],
        HAS_RESIDUAL=residual is not None,
        OUT_INT8=out_dtype == torch.int8,
        HAS_OUT_ZP=out_zero_point is not None,
        enable_fp_fusion=False,
        **cfg,
    )
    return out
