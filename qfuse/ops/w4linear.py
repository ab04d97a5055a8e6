"""The 4-bit-weight Linear: W4A16 (float activations) and W4A8 (int8 activations), its CPU
reference (the integer contract) and the dispatch to the fused Triton kernel
(``kernels.gemm.w4``, registered as ``qfuse::w4linear``).

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
from qfuse.kernels.common import GATED_ACTIVATIONS, out_features
from qfuse.ops.backend import Backend, eager, resolve_backend
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
    """``epilogue(x @ W4^T)`` for x [..., K]: the fused Triton kernel (``kernels.gemm.w4``:
    W4A16 and W4A8, the epilogue in the same launch) on CUDA (or under ``TRITON_INTERPRET=1``
    with the triton backend), else the reference.

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
    res = residual.reshape(x2.shape[0], -1) if residual is not None else None
    if resolve_backend(x.device) is Backend.TRITON:
        out = _triton(x2, call, res, out_dtype)
    else:
        out = _epilogue(gemm_reference(x2, call), call, res, out_dtype)
    return out.reshape(*lead, out.shape[-1])


def _triton(x: torch.Tensor, call: W4Call, residual: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """The fused kernel (``kernels.gemm.w4``), epilogue included: its body directly in plain
    eager calls, the ``qfuse::w4linear`` op where a tracer or compiler must see one node."""
    from qfuse.kernels.gemm.w4 import w4_gemm

    x_scale = call.x_scale if call.act_bits == 8 else None
    x_inv = call.x_inv_scale if call.act_bits == 8 else None
    if eager(x):
        return w4_gemm(x, call.weight, call.scale, call.zero, call.bias, call.in_features,
                       call.group_size, call.act, call.act_bits, x_scale, x_inv, residual,
                       out_dtype)
    return w4linear_op(x, call.weight, call.scale, call.zero, call.bias, residual, x_scale,
                       x_inv, call.in_features, call.group_size or 0, call.act, call.act_bits,
                       out_dtype)


def _op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
        bias: torch.Tensor | None, residual: torch.Tensor | None, x_scale: torch.Tensor | None,
        x_inv_scale: torch.Tensor | None, in_features: int, group_size: int, act: str,
        act_bits: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``qfuse::w4linear``: the fused kernel on 2-D x (``group_size`` 0: one group per row)."""
    from qfuse.kernels.gemm.w4 import w4_gemm

    return w4_gemm(x, weight, scale, zero, bias, in_features, group_size or None, act, act_bits,
                   x_scale, x_inv_scale, residual, out_dtype)


# Opaque (``custom_op``, not ``triton_op``): the decode schedule's programmatic dependent launch
# is a launch option ``wrap_triton`` does not forward (``kernels.gemm.opaque`` says more);
# Inductor calls it as an extern kernel and CUDA graphs capture its launches.
w4linear_op = torch.library.custom_op("qfuse::w4linear", _op, mutates_args=())


@w4linear_op.register_fake
def _(x, weight, scale, zero, bias, residual, x_scale, x_inv_scale, in_features, group_size,
      act, act_bits, out_dtype):
    return x.new_empty((x.shape[0], out_features(weight.shape[0], act)), dtype=out_dtype)
