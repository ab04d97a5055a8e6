"""The 4-bit-weight Linear: W4A16 (float activations) and W4A8 (int8 activations), its CPU
reference (the integer contract) and the dispatch to the Triton W4A16 kernel.

Reference semantics (``qfuse.int4`` defines the codes, scales and zero points):

- **W4A16**: ``W = (q - zero) * scale`` per group in float32 (exact), ``y = x @ W^T`` in float32
  whatever x's float dtype.
- **W4A8**: x is quantized to int8 (a static per-tensor scale, or per token at run time,
  symmetric), every group's partial product is an exact int32 sum
  ``acc_g = x_q[:, g] @ (q - zero)[:, g]^T``, and ``y = x_scale * sum_g acc_g * scale[:, g]``,
  the float32 sum taken over the groups in order.

Then the epilogue: ``+ bias``, the activation (a gated one on interleaved [gate, up] rows:
``act(gate) * up``), ``+ residual``, cast to ``out_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfuse import int4
from qfuse.errors import ShapeError, UnsupportedError
from qfuse.kernels.common import GATED_ACTIVATIONS
from qfuse.ops.backend import Backend, resolve_backend
from qfuse.ops.reference import ACTIVATIONS, int_matmul, quantize_int8, quantize_per_token


@dataclass(frozen=True)
class W4Call:
    """One 4-bit layer's call: packed codes ``weight`` int32 [N, ceil(K / 8)], ``scale`` float32
    [N, G], ``zero`` int8 [N, G] or None, ``bias`` float32 [N] or None; ``act_bits`` 16 (float
    activations) or 8 (int8, with ``x_scale`` / ``x_inv_scale`` static or None for per token)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bias: torch.Tensor | None
    in_features: int
    group_size: int | None
    act: str = "none"
    act_bits: int = 16
    x_scale: torch.Tensor | None = None
    x_inv_scale: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None  # None: x's float dtype


def _epilogue(y: torch.Tensor, call: W4Call, residual: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    if call.bias is not None:
        y = y + call.bias
    if call.act in GATED_ACTIVATIONS:
        gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
        y = ACTIVATIONS[GATED_ACTIVATIONS[call.act]](gate) * up
    else:
        y = ACTIVATIONS[call.act](y)
    if residual is not None:
        y = y + residual.to(torch.float32)
    return y.to(out_dtype)


def gemm_reference(x: torch.Tensor, call: W4Call) -> torch.Tensor:
    """The GEMM and scales of the reference (no epilogue): float32 [M, N] from x [M, K]."""
    q = int4.unpack(call.weight, call.in_features)
    if call.act_bits == 16:
        w = int4.dequantize_groups(q, call.scale, call.zero, call.group_size)
        return x.to(torch.float32) @ w.t()
    if call.x_inv_scale is not None:
        xq, x_scale = quantize_int8(x.to(torch.float32), call.x_inv_scale, 0.0), call.x_scale
    else:
        xq, row = quantize_per_token(x, torch.int8)
        x_scale = row[:, None]
    codes = q.to(torch.int16)
    if call.zero is not None:
        codes = codes - int4.expand(call.zero, call.in_features, call.group_size).to(torch.int16)
    size = call.group_size or call.in_features
    y = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
    for g, k0 in enumerate(range(0, call.in_features, size)):
        # (q - zero) spans [-15, 15]: int8 holds it, and int_matmul's sums stay exact
        acc = int_matmul(xq[:, k0:k0 + size], codes[:, k0:k0 + size].to(torch.int8))
        y = y + acc.to(torch.float32) * call.scale[:, g]
    return y * x_scale


def w4linear(x: torch.Tensor, call: W4Call, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``epilogue(x @ W4^T)`` for x [..., K]: the Triton W4A16 kernel on CUDA (or under
    ``TRITON_INTERPRET=1`` with the triton backend), else the reference.

    Example:
        >>> import torch
        >>> from qfuse import int4
        >>> w, x = torch.randn(6, 16), torch.randn(3, 16)
        >>> scale, zero = int4.group_qparams(w, 8, symmetric=False)
        >>> q = int4.quantize_groups(w, scale, zero, 8)
        >>> call = W4Call(int4.pack(q), scale, zero, None, 16, 8, act="relu")
        >>> y = w4linear(x, call)
        >>> ref = torch.relu(x @ int4.dequantize_groups(q, scale, zero, 8).t())
        >>> bool(torch.allclose(y, ref, atol=1e-5))
        True
    """
    k = x.shape[-1]
    if k != call.in_features:
        raise ShapeError(
            f"4-bit Linear: input has {k} features but the layer was built for "
            f"{call.in_features}; feed it the same feature size as the float model."
        )
    if not x.is_floating_point():
        raise UnsupportedError(
            f"4-bit Linear takes a float input, got {x.dtype}: the int8 hand-off between "
            "layers is not served by 4-bit layers (convert hands them float)."
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    out_dtype = call.out_dtype or x.dtype
    if call.act_bits == 16 and resolve_backend(x.device) is Backend.TRITON:
        from qfuse.kernels.gemm.w4a16 import w4a16_gemm

        y = w4a16_gemm(x2, call.weight, call.scale, call.zero, call.in_features,
                       call.group_size)
    else:
        y = gemm_reference(x2, call)
    res = residual.reshape(y.shape[0], -1) if residual is not None else None
    out = _epilogue(y, call, res, out_dtype)
    return out.reshape(*lead, out.shape[-1])
