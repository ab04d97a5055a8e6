"""``qfuse::decode_attention``: decode-step attention over a grouped-query KV cache.

The Triton kernel (``kernels.decode_attention``) reads the cache's [B, Hkv, L, D] tensors in place
for all G = H // Hkv query heads of a kv head; the CPU reference below computes the same thing
in plain PyTorch (GQA by reshape, float32 softmax, SDPA's mask semantics) and is the test oracle.
"""

from __future__ import annotations

import torch

from qfuse.kernels.common import INTERPRETED
from qfuse.ops.backend import Backend, kernel_wrap, resolve_backend


def reference(q, k, v, mask, scale):
    """[B, Sq, H, D] in q's dtype. A key is dropped where a boolean ``mask`` is False or an
    additive one is -inf; a row that drops every key is 0 (SDPA's safe softmax); finite
    additive values are added."""
    B, H, Sq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = float(scale) if scale is not None else D ** -0.5
    qg = q.float().reshape(B, Hkv, G * Sq, D)  # rows of a kv head: head-major, then position
    s = (qg @ k.float().transpose(-1, -2) * scale).reshape(B, H, Sq, L)
    keep = torch.ones((), dtype=torch.bool, device=q.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = mask
        else:
            m = mask.float()
            keep = m != float("-inf")
            s = s + m.clamp(min=torch.finfo(torch.float32).min)
    keep = keep.expand(B, H, Sq, L)
    s = s.masked_fill(~keep, float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    p = torch.exp(s - row_max.masked_fill(row_max == float("-inf"), 0.0))
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    o = p.reshape(B, Hkv, G * Sq, L) @ v.float()
    return o.reshape(B, H, Sq, D).transpose(1, 2).contiguous().to(q.dtype)


@torch.library.triton_op("qfuse::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Attention of [B, H, Sq, D] ``q`` (any strides; Sq small) over a [B, Hkv, L, D] cache
    ``k``, ``v`` (any strides, H % Hkv == 0) with ``mask`` as SDPA takes it (boolean, True
    attends, or additive; broadcastable to [B, H, Sq, L]) and ``scale`` (None: 1/sqrt(D)),
    returned as [B, Sq, H, D] contiguous in q's dtype. Not causal: the mask says what each
    query row sees.

    Example:
        >>> import torch
        >>> q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 10, 16)
        >>> out = decode_attention(q, kv, kv, None, None)
        >>> out.shape
        torch.Size([1, 1, 4, 16])
    """
    from qfuse.kernels.attention.decode import check_inputs
    from qfuse.kernels.attention.decode import decode_attention as kernel

    check_inputs(q, k, v, mask)
    if resolve_backend(q.device) is not Backend.TRITON:
        return reference(q, k, v, mask, scale)
    wrap = kernel_wrap(q.device)
    # A compiled graph or a CUDA graph being captured owns its arrival counters: fresh zeros.
    tracing = wrap is not None and (type(q) is not torch.Tensor or torch.compiler.is_compiling()
                                    or torch.cuda.is_current_stream_capturing())
    return kernel(q, k, v, mask, scale, INTERPRETED, wrap, tracing=tracing)


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    B, H, Sq, D = q.shape
    return q.new_empty((B, Sq, H, D))
