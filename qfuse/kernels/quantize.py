"""Activation quantization as its own pass: static per-tensor or dynamic per-token, int8 or fp8.

    q[M, K], scale[M] = quantize(x[M, K])

Used where quantizing inside the GEMM's prologue costs more than a pass over x: the prologue
re-quantizes each x tile once per output column block (N / BLOCK_N times), about 8 float ops per
element each time, which at large M is ALU time the tensor cores wait on; a separate pass costs
3 bytes per element of HBM traffic once. Dynamic per-token scales always come from here: a row's
scale needs the whole row before the first element can be quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.common import FP8_E4M3_MAX, quantize_fp8, quantize_int8

# Smallest scale, as primitives.SCALE_EPS (float32 eps): an all-zero row quantizes to zeros.
SCALE_EPS = tl.constexpr(1.1920928955078125e-07)


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    # pointers
    x_ptr,
    inv_scale_ptr,
    zp_ptr,
    q_ptr,
    scale_ptr,
    # dimensions
    M,
    K,
    # strides
    stride_xm,
    stride_xk,
    stride_qm,
    # meta-parameters
    FP8: tl.constexpr,
    DYNAMIC: tl.constexpr,
    INV_VEC: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    zp = 0.0
    if DYNAMIC:
        # Pass 1: the row's absolute maximum (the second pass re-reads the row from L2).
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            mask = mask_m[:, None] & (offs_k[None, :] < K - k * BLOCK_K)
            ptrs = x_ptr + offs_m[:, None] * stride_xm + (k * BLOCK_K + offs_k)[None, :] * stride_xk
            xv = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xv), axis=1))
        # scale = max(amax / qmax, eps); int8 qmax is 127.5 (primitives.choose_qparams' symmetric
        # activation convention), fp8 448. div_rn is the correctly rounded division torch does.
        if FP8:
            scale = tl.math.div_rn(amax, FP8_E4M3_MAX)
        else:
            scale = tl.math.div_rn(amax, amax * 0.0 + 127.5)
        scale = tl.maximum(scale, SCALE_EPS)
        inv = tl.math.div_rn(scale * 0.0 + 1.0, scale)[:, None]
        tl.store(scale_ptr + offs_m, scale, mask=mask_m)
    elif not INV_VEC:
        inv = tl.load(inv_scale_ptr)
    if not DYNAMIC:
        if HAS_ZP:
            zp = tl.load(zp_ptr).to(tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        cols = k * BLOCK_K + offs_k
        mask = mask_m[:, None] & (cols[None, :] < K)
        xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
        xv = xv.to(tl.float32)
        if INV_VEC:  # one inverse scale per input channel (SmoothQuant's prologue vector)
            inv = tl.load(inv_scale_ptr + cols, mask=cols < K, other=0.0)[None, :]
        if FP8:
            q = quantize_fp8(xv, inv, EXACT)
        else:
            q = quantize_int8(xv, inv, zp)
        tl.store(q_ptr + offs_m[:, None] * stride_qm + cols[None, :], q, mask=mask)


def quantize_args(x: torch.Tensor, qdtype: torch.dtype, inv_scale: torch.Tensor | None,
                  zero_point: torch.Tensor | None, exact: bool) -> tuple:
    """Outputs ``(q, scale)``, grid, arguments (in ``_quantize_kernel``'s order: the 5 pointers
    and M first) and launch options of one quantize launch; see ``quantize``."""
    M, K = x.shape
    q = torch.empty((M, K), device=x.device, dtype=qdtype)
    dynamic = inv_scale is None
    scale = torch.empty((M,), device=x.device, dtype=torch.float32) if dynamic else None
    # 4 rows of up to 1024 columns per program: 16-byte loads, and M / 4 programs fill the GPU
    # for every M where a separate pass is chosen (M >= 128).
    block_m, block_k = 4, min(1024, triton.next_power_of_2(K))
    dummy = scale if dynamic else inv_scale
    args = dict(
        x_ptr=x,
        inv_scale_ptr=inv_scale if not dynamic else dummy,
        zp_ptr=zero_point if zero_point is not None else dummy,
        q_ptr=q,
        scale_ptr=scale if dynamic else dummy,
        M=M,
        K=K,
        stride_xm=x.stride(0),
        stride_xk=x.stride(1),
        stride_qm=q.stride(0),
        FP8=qdtype == torch.float8_e4m3fn,
        DYNAMIC=dynamic,
        INV_VEC=not dynamic and inv_scale.numel() > 1,
        HAS_ZP=zero_point is not None,
        EXACT=exact,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
    )
    options = dict(num_warps=4, enable_fp_fusion=False)
    return q, scale, (-(-M // block_m),), args, options  # ceil without triton.cdiv's host cost


def quantize(
    x: torch.Tensor,
    qdtype: torch.dtype,
    inv_scale: torch.Tensor | None,
    zero_point: torch.Tensor | None,
    exact: bool,
    wrap=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize 2-D ``x`` to ``qdtype`` (int8 or float8_e4m3fn).

    ``inv_scale`` given (a scalar, or [K] per input channel): static, returns ``(q, None)``.
    ``inv_scale`` None: dynamic per-token (symmetric), returns ``(q, scale)``, ``scale`` [M].
    ``wrap``: ``torch.library.wrap_triton`` on the op's traced CUDA path.
    """
    q, scale, grid, args, options = quantize_args(x, qdtype, inv_scale, zero_point, exact)
    if isinstance(x.shape[0], int) and x.shape[0] == 0:
        return q, scale
    kernel = wrap(_quantize_kernel) if wrap is not None else _quantize_kernel
    kernel[grid](**args, **options)
    return q, scale


def quantize_with_args(x, qdtype, inv_scale, zero_point):
    """``quantize`` on CUDA, also returning the compiled kernel and its arguments (for
    ``launcher.build``): ``(q, scale, compiled, args)``."""
    q, scale, grid, args, options = quantize_args(x, qdtype, inv_scale, zero_point, False)
    compiled = _quantize_kernel[grid](**args, **options)
    return q, scale, compiled, args
