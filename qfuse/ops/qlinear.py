"""``qfuse::qlinear``: the fused quantized Linear as a torch custom op.

Being a custom op with a fake (meta) implementation is what lets ``torch.compile(fullgraph=True)``,
``torch.export`` and ``torch.jit.trace`` see one opaque node instead of tracing into Triton.
"""

from __future__ import annotations

import torch

from qfuse.errors import ShapeError
from qfuse.ops import reference
from qfuse.ops.backend import Backend, resolve_backend


@torch.library.custom_op("qfuse::qlinear", mutates_args=())
def qlinear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    x_inv_scale: torch.Tensor | None,
    x_zero_point: torch.Tensor | None,
    weight_sum: torch.Tensor | None,
    residual: torch.Tensor | None,
    out_inv_scale: torch.Tensor | None,
    out_zero_point: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Fused ``[quantize] -> int8 GEMM -> scale -> bias -> act -> [+ residual] -> [requant]``.

    ``x`` is [..., K] float (quantized with ``x_inv_scale``/``x_zero_point``) or int8;
    ``weight`` is int8 [N, K]; ``scale`` [N] = s_x * s_w; output [..., N] of ``out_dtype``
    (int8 output is requantized with ``out_inv_scale``/``out_zero_point``).
    """
    lead, K = x.shape[:-1], x.shape[-1]
    if K != weight.shape[1]:
        raise ShapeError(
            f"qfuse::qlinear: input has {K} features but the layer was built for "
            f"{weight.shape[1]}; feed it the same feature size as the float model."
        )
    x2 = x.reshape(-1, K)
    N = weight.shape[0]
    res2 = residual.reshape(-1, N) if residual is not None else None
    args = (x2, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, res2)
    args += (out_inv_scale, out_zero_point, activation, out_dtype)
    if resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.qgemm import qlinear as kernel

        out = kernel(*args)
    else:
        out = reference.qlinear(*args)
    return out.reshape(*lead, N)


@qlinear.register_fake
def _(x, weight, scale, bias, x_inv_scale, x_zero_point, weight_sum, residual, out_inv_scale,
      out_zero_point, activation, out_dtype):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)
