"""The W4A16 GEMM: float activations times 4-bit group-quantized weights, unpacked and scaled in
registers.

    y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]      (float32 acc)

The weight stays in its stored layout (``qfuse.int4``: eight codes per int32 along K, the
layout compressed-tensors checkpoints carry), so a K-step loads ``BLOCK_K / 8`` words per weight
row and each code is a shift and a mask away; group scales (and zero points) are read per
K-step: one vector per step when the group size is a multiple of ``BLOCK_K`` (``GROUP_ALIGNED``),
else per column. float32 x multiplies in IEEE float32 (the CPU reference's numbers up to the sum
order); bf16/fp16 x multiplies the dequantized weight rounded to x's dtype, accumulating in
float32.

Returns the float32 product; the epilogue (bias, activation, residual) runs after it in torch
(``ops.w4linear``). Not registered in ``families.FAMILIES``: those are schedules of the one int8 /
fp8 kernel (``kernel._qlinear_kernel``) that ``tuning`` times against each other; this kernel has
its own arguments and one fixed schedule, untimed on a GPU so far.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.errors import ShapeError
from qfuse.kernels.common import INTERPRETED_JIT


@triton.jit
def _w4a16_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    # dimensions
    M, N, K, GROUP,
    # strides (the weight's, scales' and output's K / N strides are 1)
    stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
    # meta-parameters
    HAS_ZP: tl.constexpr, GROUP_ALIGNED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x [M, K] float, w int32 [N, ceil(K / 8)], s float32 [N, G], z int8 [N, G] -> y [M, N]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        # [BLOCK_K, BLOCK_N]: each code's word, then its nibble (stored as q + 8)
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k[:, None] // 8),
                        mask=wmask, other=0)
        q = ((words >> ((offs_k[:, None] % 8) * 4)) & 0xF) - 8
        if GROUP_ALIGNED:
            g = k0 // GROUP
            scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)[None, :]
            if HAS_ZP:
                zero = tl.load(z_ptr + offs_n * stride_sn + g, mask=mask_n, other=0)
                q = q - zero.to(tl.int32)[None, :]
        else:
            g = offs_k // GROUP
            gptr = offs_n[None, :] * stride_sn + g[:, None]
            scale = tl.load(s_ptr + gptr, mask=wmask, other=0.0)
            if HAS_ZP:
                q = q - tl.load(z_ptr + gptr, mask=wmask, other=0).to(tl.int32)
        w = q.to(tl.float32) * scale
        if IEEE:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        elif INTERPRETED_JIT:
            # The interpreter's bf16 casts truncate and its bf16 dot is wrong (checked on
            # triton 3.7): it multiplies the float32 weight, as the reference does.
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               zero: torch.Tensor | None, in_features: int, group_size: int | None,
               block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """float32 ``x @ W^T`` [M, N] for x [M, K] (float32, bf16 or fp16) and the packed 4-bit
    ``weight`` with its group ``scale`` / ``zero`` (``qfuse.int4``)."""
    M, K = x.shape
    N = weight.shape[0]
    if K != in_features or weight.shape[1] * 8 < K:
        raise ShapeError(f"w4a16_gemm: x has {K} features, the weight {in_features} "
                         f"({weight.shape[1]} words per row).")
    group = group_size or K
    scale = scale.contiguous()
    zero = zero.contiguous() if zero is not None else None
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_kernel[grid](
        x, weight, scale, zero if zero is not None else scale, y,
        M, N, K, group,
        x.stride(0), x.stride(1), weight.stride(0), scale.stride(0), y.stride(0),
        HAS_ZP=zero is not None, GROUP_ALIGNED=group % block_k == 0,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
