"""``qfuse::layer_norm_quant``: LayerNorm (or RMSNorm) whose output also leaves quantized for
the next GEMMs.

Returns ``(y, q)``: ``y`` the LayerNorm in ``x``'s dtype (empty when ``write_y`` is False: no
float reader), ``q`` = ``y`` quantized with a static scale (int8 with an optional zero point, or
fp8 e4m3). The CPU reference is ``F.layer_norm`` followed by the reference quantizer, i.e. exactly
the unfused graph; the Triton kernel agrees up to the LayerNorm's float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.kernels.common import INTERPRETED
from qfuse.ops import reference
from qfuse.ops.backend import Backend, eager, kernel_wrap, resolve_backend


def _reference(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y, rms=False):
    if rms:  # the ops transformers' RMSNorm runs, in its order (what the unfused graph does)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * h.to(x.dtype) if weight is not None else h.to(x.dtype)
    else:
        y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    yf = y.float()
    if qdtype == torch.float8_e4m3fn:
        q = reference.quantize_fp8(yf, inv_scale)
    else:
        zp = zero_point.float() if zero_point is not None else 0.0
        q = reference.quantize_int8(yf, inv_scale, zp)
    return (y if write_y else x.new_empty((0,))), q


@torch.library.triton_op("qfuse::layer_norm_quant", mutates_args=())
def layer_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    inv_scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    qdtype: torch.dtype,
    write_y: bool,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``x`` is [..., D], normalized over D (``rms``: RMSNorm, no
    bias, as transformers computes it)."""
    if resolve_backend(x.device) is not Backend.TRITON:
        return _reference(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y, rms)
    from qfuse.kernels.layernorm import layer_norm_quant as kernel

    lead, D = x.shape[:-1], x.shape[-1]
    y, q = kernel(x.reshape(-1, D).contiguous(), weight, bias, eps, inv_scale, zero_point,
                  qdtype, write_y, INTERPRETED, kernel_wrap(x.device), rms)
    return (y.view(*lead, D) if write_y else y), q.view(*lead, D)


@layer_norm_quant.register_fake
def _(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y, rms=False):
    y = x.new_empty(x.shape if write_y else (0,))
    return y, x.new_empty(x.shape, dtype=qdtype)


_PLANS: dict = {}  # eager CUDA launches: key -> CachedLaunch (or the reason there is none)


def layer_norm_quant_call(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y,
                          rms=False):
    """What converted graphs call: the op where traced, compiled or exported; in plain eager on
    CUDA the kernel through a cached launch (``kernels.launcher``), skipping the dispatcher and
    Triton's launch (together more host time per LayerNorm than the kernel runs)."""
    if not (eager(x) and x.is_cuda and x.is_contiguous() and not INTERPRETED
            and resolve_backend(x.device) is Backend.TRITON):
        return torch.ops.qfuse.layer_norm_quant(x, weight, bias, eps, inv_scale, zero_point,
                                                qdtype, write_y, rms)
    from qfuse.kernels import layernorm as k
    from qfuse.kernels.launcher import build, raw_stream

    D = x.shape[-1]
    M = x.numel() // D
    rows = k.rows_per_program(D, M)
    key = (x.device, D, rows, x.dtype, qdtype, write_y, weight is None, bias is None,
           zero_point is None, float(eps), rms)
    plan = _PLANS.get(key)
    if plan is None or isinstance(plan, str) or x.data_ptr() % 16:
        x2 = x.reshape(M, D)
        grid, args, options, y, q = k.launch_args(x2, weight, bias, eps, inv_scale, zero_point,
                                                  qdtype, write_y, False, rms)
        compiled = k._ln_quant_kernel[grid](**args, **options)
        if plan is None:
            _PLANS[key] = build(compiled, k._ln_quant_kernel, args, 8)
    else:
        y = x.new_empty(x.shape if write_y else (0,))
        q = x.new_empty(x.shape, dtype=qdtype)
        dummy = inv_scale
        plan(-(-M // rows), 1, raw_stream(x.device), x,
             weight if weight is not None else dummy, bias if bias is not None else dummy,
             inv_scale, zero_point if zero_point is not None else dummy,
             y if write_y else q, q, M)
    return (y.view(x.shape) if write_y else y), q.view(x.shape)
