"""Max-pooling of channels-last int8 / fp8 (or float) activations.

Quantizing is monotonic (round, then clamp), so ``max(q(x)) == q(max(x))`` exactly: a conv can
requantize before the pool and the pool can run on its int8/fp8 output, reading and writing a
quarter of what bf16 pooling moves (ResNet's 3x3 stride-2 stem pool reads 51 MB of bf16 at batch
32). Padding taps never win (each window holds a real element, which
PyTorch requires of max-pool padding), so they are masked to the dtype's smallest value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.layout import empty_nhwc
from qfuse.primitives import FP8_E4M3_MAX

FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["M"])
def _maxpool_kernel(x_ptr, out_ptr, M, H, W, OH, OW, C, sxn, sxh, sxw, sxc,
                    SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                    DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    LOWEST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_m = offs_m < M
    mask_c = offs_c < C
    ow = offs_m % OW
    oh = (offs_m // OW) % OH
    rows = x_ptr + ((offs_m // OW) // OH).to(tl.int64) * sxn
    best = tl.full((BLOCK_M, BLOCK_C), LOWEST, tl.float32)
    for tap in tl.static_range(KH * KW):
        ih = oh * SH - PH + (tap // KW) * DH
        iw = ow * SW - PW + (tap % KW) * DW
        valid = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        ptrs = (rows + ih * sxh + iw * sxw)[:, None] + (offs_c * sxc)[None, :]
        tap_mask = valid[:, None] & mask_c[None, :]
        # Masked taps become LOWEST through a select, not through the load's ``other``: on an
        # H100 (triton 3.6) ``other=-128`` on vectorized int8 loads filled padding taps with 0,
        # which beat every all-zero-point window of an asymmetric ReLU output (ResNet's stem
        # pool: 17% of outputs off by up to 127 codes). The interpreter got it right.
        v = tl.load(ptrs, mask=tap_mask)
        v = tl.where(tap_mask, v.to(tl.float32), LOWEST)  # exact for int8, fp8 and bf16/fp16
        best = tl.maximum(best, v)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :]
    tl.store(out, best.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


def output_size(size, kernel, stride, padding, dilation, ceil_mode) -> int:
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:  # PyTorch: last window starts inside
        out -= 1
    return out


def max_pool2d(x: torch.Tensor, kernel, stride, padding, dilation, ceil_mode: bool,
               launcher=None) -> torch.Tensor:
    """``F.max_pool2d`` of NCHW-shaped ``x`` (any strides; channels-last is the fast layout),
    int8/fp8/float, as a channels-last tensor of the same dtype.

    Example (on CPU this runs under the Triton interpreter, TRITON_INTERPRET=1):
        >>> import torch
        >>> from qfuse.kernels.pool import max_pool2d
        >>> x = torch.randint(-128, 128, (2, 5, 7, 6), dtype=torch.int8)
        >>> ref = torch.nn.functional.max_pool2d(x.float(), 3, 2, 1).to(torch.int8)
        >>> bool(torch.equal(max_pool2d(x, [3, 3], [2, 2], [1, 1], [1, 1], False), ref))
        True
    """
    launch = launcher or (lambda k: k)
    n, c, h, w = x.shape
    oh = output_size(h, kernel[0], stride[0], padding[0], dilation[0], ceil_mode)
    ow = output_size(w, kernel[1], stride[1], padding[1], dilation[1], ceil_mode)
    out = empty_nhwc((n, c, oh, ow), x.dtype, x.device)
    m = n * oh * ow
    if m == 0 or c == 0:
        return out
    lowest = {torch.int8: -128.0, FP8: -FP8_E4M3_MAX}.get(x.dtype, float("-inf"))
    block_c = 32 if c >= 32 else 16  # 8 outputs per thread: the taps are unrolled (see the
    block_m = 1024 // block_c        # register note in conv.depthwise.pick_depthwise_config)
    sx = x.stride()
    launch(_maxpool_kernel)[(triton.cdiv(m, block_m), triton.cdiv(c, block_c))](
        x, out, m, h, w, oh, ow, c, sx[0], sx[2], sx[3], sx[1],
        SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0],
        DW=dilation[1], KH=kernel[0], KW=kernel[1], LOWEST=lowest, BLOCK_M=block_m,
        BLOCK_C=block_c, num_warps=4,
    )
    return out
