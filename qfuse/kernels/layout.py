"""The channels-last (NHWC) layout of the conv and pool ops' outputs, in exactly one set of strides.

Allocated with ``torch.empty_strided``, not ``torch.empty(..., memory_format=channels_last)``:
Inductor lowers ``aten.empty`` to contiguous strides whatever its memory format, so in a compiled
graph each kernel output was allocated NCHW, copied to NHWC (a zero fill) for the kernel, and
copied back after it; where both stride sets describe the same memory (a 1x1 map, as in
squeeze-excitation) that copy-back read and wrote one buffer and Inductor's scheduler failed
(``KeyError: 'op17'``, issue #11). A traced op's fake output, its Triton body's and its CPU
reference's also need the same strides, and ``.contiguous(memory_format=...)`` keeps a tensor
whose size-1 dimensions already pass the channels-last check as it is ([4, 8, 1, 1]: strides
(8, 1, 1, 1) against a fresh channels-last tensor's (8, 1, 8, 8)).
"""

from __future__ import annotations

import torch


def empty_nhwc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised [N, C, H, W] tensor in the canonical channels-last strides
    ``(H*W*C, 1, W*C, C)``: what every conv/pool path returns.

    Example:
        >>> import torch
        >>> empty_nhwc((4, 8, 1, 1), torch.int8, "cpu").stride()
        (8, 1, 8, 8)
    """
    n, c, h, w = shape
    return torch.empty_strided(shape, (h * w * c, 1, w * c, c), dtype=dtype, device=device)


def as_nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` with ``empty_nhwc``'s strides: itself when it has them, else a copy.

    Example:
        >>> import torch
        >>> as_nhwc(torch.zeros(4, 8, 1, 1)).stride()
        (8, 1, 8, 8)
    """
    out = empty_nhwc(t.shape, t.dtype, t.device)
    if t.stride() == out.stride():
        return t
    return out.copy_(t)
