"""What a converted graph hands ``scaled_dot_product_attention`` as its mask.

``torch.export`` cannot see that a padding mask is all ones, so a captured BERT builds a boolean
mask [batch, 1, seq, seq] and passes it to every attention call, where SDPA turns it into an
additive float mask again (a fill and a ``where`` kernel per layer) and picks a masked attention
kernel. transformers' own eager forward checks the mask once and passes none when nothing is
masked. ``drop_full_mask`` does the same for the converted graph: measured on an H100 with
MiniLM-L6 32x128 (``bench/results/diag_eager_h100.txt``), the masked path cost 12 extra kernels
per forward, 93.5 against 52.8 us of attention, and 557 against 206 us of cuDNN attention host
time.
"""

from __future__ import annotations

import torch


def drop_full_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """None for a boolean ``mask`` that keeps every position, in plain eager calls; ``mask``
    itself otherwise (a float mask, a meta tensor, a traced, compiled, exported or graph-captured
    call, where checking the values would need a device sync or has no values).

    Example:
        >>> import torch
        >>> drop_full_mask(torch.ones(2, 1, 3, 3, dtype=torch.bool)) is None
        True
        >>> drop_full_mask(torch.tensor([[True, False]])).tolist()
        [[True, False]]
    """
    if (
        mask.dtype != torch.bool
        or type(mask) is not torch.Tensor
        or mask.is_meta
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or (mask.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return mask
    return None if bool(mask.all()) else mask
