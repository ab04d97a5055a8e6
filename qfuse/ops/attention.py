"""Attention in converted graphs: the mask SDPA is handed, and ``qfuse::attention_quant``.

``qfuse::attention_quant`` (below ``drop_full_mask``) is encoder attention that writes its output
in the [B, S, H*D] layout of the attention-output Linear, quantized with that Linear's static
input scale where it reads int8/fp8 (``fusion.attention_quant`` puts it in the graph): one pass
instead of SDPA, a transpose copy and the Linear's quantize pass.

What a converted graph hands ``scaled_dot_product_attention`` as its mask:

``torch.export`` cannot see that a padding mask is all ones, so a captured BERT builds a boolean
mask [batch, 1, seq, seq] and passes it to every attention call, where SDPA turns it into an
additive float mask again (a fill and a ``where`` kernel per layer) and picks a masked attention
kernel. transformers' own eager forward checks the mask once and passes none when nothing is
masked. ``drop_full_mask`` does the same for the converted graph: measured on an H100 with
MiniLM-L6, the masked path cost 12 extra kernels per forward, nearly doubled the attention's
GPU time and more than doubled cuDNN attention's host time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.kernels.common import INTERPRETED
from qfuse.ops import reference
from qfuse.ops.backend import Backend, eager, kernel_wrap, resolve_backend


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


# ---- qfuse::attention_quant: attention whose output leaves in the next GEMM's input form ----

_QUANT = (torch.int8, torch.float8_e4m3fn)


def _reference(q, k, v, mask, scale, inv_scale, zero_point, out_dtype):
    """The unfused graph's numbers: SDPA (here in float32), the [B, S, H*D] layout in q's float
    dtype, then the reference quantizer of the reading layer."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, scale=scale)
    B, H, S, D = o.shape
    y = o.transpose(1, 2).reshape(B, S, H * D).to(q.dtype)
    if out_dtype not in _QUANT:
        return y
    if out_dtype == torch.float8_e4m3fn:
        return reference.quantize_fp8(y.float(), inv_scale)
    zp = zero_point.float() if zero_point is not None else 0.0
    return reference.quantize_int8(y.float(), inv_scale, zp)


@torch.library.triton_op("qfuse::attention_quant", mutates_args=())
def attention_quant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    inv_scale: torch.Tensor | None,
    zero_point: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Non-causal attention of [B, H, S, D] ``q``, ``k``, ``v`` (any strides; ``mask`` boolean,
    True keeps, or additive, broadcastable to [B, H, S_Q, S_K]; ``scale`` None: 1/sqrt(D), as
    SDPA's) written as [B, S_Q, H*D]: in q's float dtype, or that quantized with ``inv_scale``
    (and ``zero_point``) to ``out_dtype`` int8 / float8_e4m3fn. The CPU reference is SDPA in
    float32 followed by the cast and the reference quantizer; the Triton kernel
    (``kernels.attention``) agrees up to the attention's float rounding.

    Example:
        >>> import torch
        >>> q = torch.randn(2, 4, 8, 16)
        >>> out = attention_quant(q, q, q, None, 0.25, torch.tensor(40.0), None, torch.int8)
        >>> out.shape, out.dtype
        (torch.Size([2, 8, 64]), torch.int8)
    """
    from qfuse.kernels.attention.encoder import attention as kernel
    from qfuse.kernels.attention.encoder import check_inputs

    check_inputs(q, k, v, mask, out_dtype, inv_scale)
    if resolve_backend(q.device) is not Backend.TRITON:
        return _reference(q, k, v, mask, scale, inv_scale, zero_point, out_dtype)
    return kernel(q, k, v, mask, scale, inv_scale, zero_point, out_dtype, INTERPRETED,
                  kernel_wrap(q.device))


@attention_quant.register_fake
def _(q, k, v, mask, scale, inv_scale, zero_point, out_dtype):
    B, H, S, D = q.shape
    return q.new_empty((B, S, H * D), dtype=out_dtype)


_PLANS: dict = {}  # eager CUDA launches: key -> (CachedLaunch or why there is none, grid)


def attention_quant_call(q, k, v, mask, scale, inv_scale, zero_point, out_dtype):
    """What converted graphs call (``fusion.attention_quant``): the op where traced, compiled or
    exported; in plain eager on CUDA the kernel through a cached launch (``kernels.launcher``),
    skipping the dispatcher and Triton's launch, as ``layer_norm_quant_call`` does. A plan is
    kept per shape and strides (every integer argument is fixed by them)."""
    if not (eager(q) and q.is_cuda and not INTERPRETED
            and resolve_backend(q.device) is Backend.TRITON):
        return torch.ops.qfuse.attention_quant(q, k, v, mask, scale, inv_scale, zero_point,
                                               out_dtype)
    from qfuse.kernels.attention import encoder as kernels
    from qfuse.kernels.launcher import build, raw_stream

    key = (q.device, q.dtype, out_dtype, tuple(q.shape), tuple(k.shape), q.stride(), k.stride(),
           v.stride(), None if mask is None else (mask.dtype, tuple(mask.shape), mask.stride()),
           inv_scale is None, zero_point is None, scale)
    # Triton specializes pointers on 16-byte alignment: a plan serves aligned tensors only.
    aligned = all(t.data_ptr() % 16 == 0 for t in (q, k, v, mask) if t is not None)
    plan = _PLANS.get(key)
    if plan is None or isinstance(plan[0], str) or not aligned:
        grid, args, options, out = kernels.launch_args(q, k, v, mask, scale, inv_scale,
                                                       zero_point, out_dtype, False)
        compiled = kernels._attention_kernel[grid](**args, **options)
        if plan is None and aligned:
            _PLANS[key] = (build(compiled, kernels._attention_kernel, args, 7), grid)
        return out
    launch, grid = plan
    B, H, S, D = q.shape
    out = q.new_empty((B, S, H * D), dtype=out_dtype)
    launch(grid[0], grid[1], raw_stream(q.device), q, k, v, mask if mask is not None else out,
           inv_scale if inv_scale is not None else out,
           zero_point if zero_point is not None else out, out)
    return out
