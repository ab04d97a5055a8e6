"""``qfuse::layer_norm_quant``: LayerNorm whose output also leaves quantized for the next GEMMs.

Returns ``(y, q)``: ``y`` the LayerNorm in ``x``'s dtype (empty when ``write_y`` is False: no
float reader), ``q`` = ``y`` quantized with a static scale (int8 with an optional zero point, or
fp8 e4m3). The CPU reference is ``F.layer_norm`` followed by the reference quantizer, i.e. exactly
the unfused graph; the Triton kernel agrees up to the LayerNorm's float rounding.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qfuse.ops import reference
from qfuse.ops.backend import Backend, resolve_backend

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _reference(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y):
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; ``x`` is [..., D], normalized over D."""
    if resolve_backend(x.device) is not Backend.TRITON:
        return _reference(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y)
    from qfuse.kernels.layernorm import layer_norm_quant as kernel

    lead, D = x.shape[:-1], x.shape[-1]
    wrap = torch.library.wrap_triton if x.device.type == "cuda" and not INTERPRETED else None
    y, q = kernel(x.reshape(-1, D).contiguous(), weight, bias, eps, inv_scale, zero_point,
                  qdtype, write_y, INTERPRETED, wrap)
    return (y.view(*lead, D) if write_y else y), q.view(*lead, D)


@layer_norm_quant.register_fake
def _(x, weight, bias, eps, inv_scale, zero_point, qdtype, write_y):
    y = x.new_empty(x.shape if write_y else (0,))
    return y, x.new_empty(x.shape, dtype=qdtype)
