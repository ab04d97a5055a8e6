"""``qfuse::qconv2d``: the fused quantized Conv2d as a torch custom op (reference on every device).

A Triton implicit-GEMM kernel is a later issue; until then CUDA runs the same PyTorch reference
(float64 convolution of integer values, exact) and ``qfuse.summary`` says so.
"""

from __future__ import annotations

import torch

from qfuse.ops import reference
from qfuse.ops.backend import resolve_backend


@torch.library.custom_op("qfuse::qconv2d", mutates_args=())
def qconv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
) -> torch.Tensor:
    """Fused ``[quantize] -> int8 conv2d -> scale -> bias -> act -> [+ residual] -> [requant]``."""
    resolve_backend(x.device, has_triton_kernel=False)
    return reference.qconv2d(
        x,
        weight,
        scale,
        bias,
        x_inv_scale,
        x_zero_point,
        residual,
        out_inv_scale,
        out_zero_point,
        activation,
        out_dtype,
        stride,
        padding,
        dilation,
        groups,
    )


@qconv2d.register_fake
def _(
    x,
    weight,
    scale,
    bias,
    x_inv_scale,
    x_zero_point,
    residual,
    out_inv_scale,
    out_zero_point,
    activation,
    out_dtype,
    stride,
    padding,
    dilation,
    groups,
):
    n, _, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return x.new_empty((n, weight.shape[0], oh, ow), dtype=out_dtype)
