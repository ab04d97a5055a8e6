"""The ops a QDQ export is written in, as ``torch.library`` custom ops with their ONNX twins.

``qfuse_onnx::quantize`` / ``dequantize`` are ONNX QuantizeLinear / DequantizeLinear, op for op
(divide by the scale, round half to even, add the zero point, saturate to the zero point's
dtype; per-tensor or per-axis), ``matmul_integer`` is MatMulInteger (int8 x int8 -> int32) and
``gemm`` a Gemm without bias. The rewritten graph (``graph.py``) calls them, so the torch module
that ``torch.onnx.export`` traces computes exactly what the ONNX graph will; ``translations()``
tells the exporter to write each as its single ONNX node, scales and zero points as initializers
(``torch.onnx`` keeps DequantizeLinear out of constant folding: int8 weights stay int8).
"""

from __future__ import annotations

import torch

QDTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)


def _along(t: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A per-axis parameter (1-D) shaped to broadcast against ``x`` on ``axis``; 0-d as it is."""
    if t.dim() == 0:
        return t
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


@torch.library.custom_op("qfuse_onnx::quantize", mutates_args=())
def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
             axis: int) -> torch.Tensor:
    """ONNX QuantizeLinear: ``saturate(round(x / scale) + zero_point)`` in zero_point's dtype.

    Example:
        >>> import torch
        >>> x = torch.tensor([0.25, -1.0, 100.0])
        >>> quantize(x, torch.tensor(0.5), torch.tensor(0, dtype=torch.int8), 0).tolist()
        [0, -2, 127]
    """
    v = x.float() / _along(scale.float(), x, axis)
    if zero_point.dtype == torch.float8_e4m3fn:
        return torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn)
    info = torch.iinfo(zero_point.dtype)
    v = torch.round(v) + _along(zero_point.float(), x, axis)
    return torch.clamp(v, info.min, info.max).to(zero_point.dtype)


@quantize.register_fake
def _(x, scale, zero_point, axis):
    return torch.empty_like(x, dtype=zero_point.dtype)


@torch.library.custom_op("qfuse_onnx::dequantize", mutates_args=())
def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
               axis: int) -> torch.Tensor:
    """ONNX DequantizeLinear: ``(q - zero_point) * scale`` in float32.

    Example:
        >>> import torch
        >>> q = torch.tensor([-3, 5], dtype=torch.int8)
        >>> dequantize(q, torch.tensor(0.5), torch.tensor(1, dtype=torch.int8), 0).tolist()
        [-2.0, 2.0]
    """
    zp = _along(zero_point.float(), q, axis)
    return (q.float() - zp) * _along(scale.float(), q, axis)


@dequantize.register_fake
def _(q, scale, zero_point, axis):
    return torch.empty_like(q, dtype=torch.float32)


@torch.library.custom_op("qfuse_onnx::matmul_integer", mutates_args=())
def matmul_integer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ONNX MatMulInteger without zero points: int8 ``a`` [..., K] @ int8 ``b`` [K, N] -> int32.

    Example:
        >>> import torch
        >>> a = torch.tensor([[1, -2]], dtype=torch.int8)
        >>> b = torch.tensor([[3], [4]], dtype=torch.int8)
        >>> matmul_integer(a, b).tolist()
        [[-5]]
    """
    # float64 holds every int8 x int8 partial sum exactly for K < 2**38
    return torch.matmul(a.double(), b.double()).to(torch.int32)


@matmul_integer.register_fake
def _(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=torch.int32)


@torch.library.custom_op("qfuse_onnx::gemm", mutates_args=())
def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ONNX Gemm without bias: float ``a`` [M, K] @ ``b`` [K, N].

    A 2-D MatMul followed by its bias Add is what onnxruntime's MatMul+Add fusion turns into a
    float Gemm before its QDQ fusions run; a Gemm without bias becomes QGemm, the Add stays.

    Example:
        >>> import torch
        >>> gemm(torch.ones(1, 2), torch.ones(2, 3)).tolist()
        [[2.0, 2.0, 2.0]]
    """
    return a @ b


@gemm.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def translations() -> dict:
    """``torch.onnx.export``'s ``custom_translation_table`` for the ops above (onnxscript is
    imported here: only an ONNX export needs it)."""
    from onnxscript import opset19 as op

    def quantize_onnx(x, scale, zero_point, axis: int):
        return op.QuantizeLinear(x, scale, zero_point, axis=axis)

    def dequantize_onnx(q, scale, zero_point, axis: int):
        return op.DequantizeLinear(q, scale, zero_point, axis=axis)

    def matmul_integer_onnx(a, b):
        return op.MatMulInteger(a, b)

    def gemm_onnx(a, b):
        return op.Gemm(a, b)

    return {
        torch.ops.qfuse_onnx.quantize.default: quantize_onnx,
        torch.ops.qfuse_onnx.dequantize.default: dequantize_onnx,
        torch.ops.qfuse_onnx.matmul_integer.default: matmul_integer_onnx,
        torch.ops.qfuse_onnx.gemm.default: gemm_onnx,
    }
