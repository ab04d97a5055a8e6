"""``qfuse::max_pool2d``: max-pooling that also takes int8 / fp8 activations.

ATen's max_pool2d has no int8 or fp8 kernels; a fused conv that hands its readers int8 through a
max-pool (ResNet's stem) needs one. CUDA tensors run the Triton kernel (``qfuse.kernels.pool``,
through ``wrap_triton`` when traced, so torch.compile sees it); CPU tensors pool in float32 and
cast back, which is exact for int8 and fp8 values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.kernels.layout import as_nhwc, empty_nhwc
from qfuse.kernels.pool import output_size
from qfuse.ops.backend import Backend, eager, resolve_backend


def _impl(x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int],
          dilation: list[int], ceil_mode: bool) -> torch.Tensor:
    """Max-pool of NCHW-shaped ``x`` (int8, fp8 or float); the result is channels-last."""
    if resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.pool import max_pool2d as kernel

        launcher = None if eager(x) or x.device.type == "cpu" else torch.library.wrap_triton
        return kernel(x, kernel_size, stride, padding, dilation, ceil_mode, launcher=launcher)
    out = F.max_pool2d(x.float(), kernel_size, stride, padding, dilation, ceil_mode)
    return as_nhwc(out.to(x.dtype))


max_pool2d = torch.library.triton_op("qfuse::max_pool2d", _impl, mutates_args=())


@max_pool2d.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    n, c, h, w = x.shape
    oh = output_size(h, kernel_size[0], stride[0], padding[0], dilation[0], ceil_mode)
    ow = output_size(w, kernel_size[1], stride[1], padding[1], dilation[1], ceil_mode)
    return empty_nhwc((n, c, oh, ow), x.dtype, x.device)


def max_pool2d_call(x, kernel_size, stride, padding, dilation, ceil_mode) -> torch.Tensor:
    """What the fused graph calls: the op's Python body in plain eager inference (no dispatcher
    cost), the ``qfuse::max_pool2d`` op where it is traced, compiled or exported.

    Example:
        >>> import torch
        >>> x = torch.randint(-128, 128, (1, 4, 5, 5), dtype=torch.int8)
        >>> max_pool2d_call(x, [3, 3], [2, 2], [1, 1], [1, 1], False).shape
        torch.Size([1, 4, 3, 3])
    """
    fn = _impl if eager(x) else torch.ops.qfuse.max_pool2d
    return fn(x, kernel_size, stride, padding, dilation, ceil_mode)
