"""qfuse's fused layers rewritten as the QDQ pattern onnxruntime and TensorRT fuse.

Each module computes, in plain torch ops plus ``ops.quantize`` / ``ops.dequantize``, what the
fused layer computes, in the form the engines recognise (the layout onnxruntime's own
quantization tool writes):

    x (float) -> QuantizeLinear -> DequantizeLinear --\
    W (int8 initializer) -> DequantizeLinear(axis) ----> MatMul | Conv -> + bias -> act
        -> [+ residual] -> [post-act] -> [QuantizeLinear: the int8 hand-off to the next layer]

An int8 input handed over by the previous fused layer arrives as that layer's QuantizeLinear
output and only needs the DequantizeLinear. Scales and zero points are qfuse's own buffers, so
the integers are qfuse's integers: onnxruntime runs the Linear as ``MatMulIntegerToFloat``
(int32 accumulation times ``x_scale * w_scale``, plus the float bias: qfuse's epilogue), and a
Conv followed by its QuantizeLinear as ``QLinearConv``.

What the ONNX form cannot say exactly is written as its nearest equivalent and described in
``self.notes`` (``export_onnx`` returns and records them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qfuse.errors import UnsupportedError
from qfuse.export.onnx.ops import dequantize, gemm, matmul_integer, quantize
from qfuse.kernels.common import GATED_ACTIVATIONS
from qfuse.primitives import SCALE_EPS, divide

FP8 = torch.float8_e4m3fn

ACTIVATIONS = {
    "none": lambda y: y,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "relu6": lambda y: torch.clamp(y, 0.0, 6.0),
    "hardswish": F.hardswish,
}
# Activations that commute with quantization (piecewise identity or constant): Q(act(y)) equals
# Q(act(DQ(Q(y)))), so a Conv can end in its QuantizeLinear (QLinearConv) and apply them after.
CLAMPS = ("relu", "relu6")


class ActivationQParams(nn.Module):
    """Scale and zero point of one quantized activation, as ONNX tensors: int8 as qfuse stores
    it, or uint8 with the zero point moved up by 128 (``activations="uint8"``): the same real
    values, since clamp(round(x / s) + zp, -128, 127) + 128 = clamp(round(x / s) + zp + 128, 0,
    255)."""

    def __init__(self, scale, zero_point, qdtype: torch.dtype, act_dtype: torch.dtype):
        super().__init__()
        zp = int(zero_point) if zero_point is not None else 0
        if qdtype == FP8:
            dtype, zp = FP8, 0
        else:
            dtype, zp = act_dtype, zp + (128 if act_dtype == torch.uint8 else 0)
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32).reshape(()))
        self.register_buffer("zero_point", torch.tensor(zp).to(dtype))
        # the zero point is the dtype's minimum: a ReLU before the QuantizeLinear is a no-op
        self.qmin_zero_point = dtype != FP8 and zp == torch.iinfo(dtype).min

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return quantize(x.float(), self.scale, self.zero_point, 1)

    def dq(self, q: torch.Tensor) -> torch.Tensor:
        return dequantize(q, self.scale, self.zero_point, 1)


def _weight_dq_params(scale: torch.Tensor, qdtype: torch.dtype):
    return scale.float().contiguous(), torch.zeros(scale.numel(), dtype=qdtype)


class QDQLinear(nn.Module):
    """A ``QLinear`` as ``[Q] -> DQ -> MatMul(DQ(W^T)) -> + bias -> act -> [+ residual] -> [Q]``.

    The weight is stored transposed ([K, N], per-channel axis 1) so the MatMul reads the
    DequantizeLinear directly (a Transpose in between hides the pattern from onnxruntime); a
    2-D input takes a bias-less Gemm (``ops.gemm``: onnxruntime's QGemm) and the bias Add.
    Dynamic per-token layers have no QDQ form (QuantizeLinear's scale is a constant per tensor
    or per channel); they are written as the explicit row-wise quantization qfuse runs and
    ``MatMulInteger`` (int8 kernels in onnxruntime; TensorRT has no MatMulInteger).
    """

    def __init__(self, lin, name: str, act_dtype: torch.dtype):
        super().__init__()
        self.name, self.notes = name, []
        b = {k: v for k, v in lin._buffers.items() if v is not None}
        weight, w_scale = b["weight"], b["weight_scale"].float()
        self.qdtype = weight.dtype
        self.activation = lin.activation
        self.out_dtype = lin.out_dtype
        bias = b.get("bias")
        if "x_zero_point" in b and bias is not None:
            # convert folded -zp_x * colsum(W) * scale into the bias; DequantizeLinear subtracts
            # the zero point itself, so the ONNX graph needs the bias before that fold.
            wsum = weight.to(torch.float64).sum(1)
            bias = (bias.double() + b["x_zero_point"].double() * wsum * b["scale"].double())
        if self.activation in GATED_ACTIVATIONS:
            # interleaved [g0, u0, g1, u1, ...] rows -> [gates | ups]: two Slices instead of a
            # strided gather, the same column values
            order = torch.cat([torch.arange(0, weight.shape[0], 2),
                               torch.arange(1, weight.shape[0], 2)])
            weight, w_scale = weight[order], w_scale[order]
            bias = bias[order] if bias is not None else None
        self.register_buffer("weight", weight.t().contiguous())  # [K, N]
        s, z = _weight_dq_params(w_scale, self.qdtype)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_zero_point", z)
        self.register_buffer("bias", bias.float() if bias is not None else None)
        self.dynamic = lin.dynamic
        self.input_quantized = lin.input_quantized
        self.smooth = None
        if self.dynamic:
            if self.qdtype == FP8:
                raise UnsupportedError(
                    f"layer {name}: fp8 with dynamic per-token activation scales has no ONNX "
                    "form (QuantizeLinear takes a constant scale; MatMulInteger is int8 only). "
                    "Export an fp8_static or int8_dynamic model, or keep_float this layer.")
            self.register_buffer("w_scale_row", w_scale.contiguous())
            self.notes.append(
                f"{name}: dynamic per-token int8 written as row-wise quantize ops + "
                "MatMulInteger (no QDQ form; TensorRT has no MatMulInteger)")
            self.x = None
        else:
            self.x = ActivationQParams(b["x_scale"], b.get("x_zero_point"), self.qdtype,
                                       act_dtype)
            inv = b["x_inv_scale"]
            if inv.numel() > 1:  # SmoothQuant's per-input-channel prologue vector
                self.register_buffer("smooth", (inv.double() * b["x_scale"].double()).float())
                self.notes.append(f"{name}: SmoothQuant prologue written as Mul(x, 1/s) before "
                                  "QuantizeLinear (two float roundings where qfuse has one)")
        self.out = None
        if self.out_dtype in (torch.int8, FP8):
            self.out = ActivationQParams(b["out_scale"], b.get("out_zero_point"), self.qdtype,
                                         act_dtype)

    def _per_token(self, x: torch.Tensor) -> torch.Tensor:
        """``reference.qlinear``'s dynamic path op for op: quantize each row with
        ``max(amax / 127.5, eps)``, int32 GEMM, then ``acc * w_scale * row_scale``."""
        x = x.float()
        row = torch.clamp(divide(x.abs().amax(-1, keepdim=True), 127.5), min=SCALE_EPS)
        v = torch.round(torch.clamp(x * torch.reciprocal(row), -256.0, 256.0))
        q = torch.clamp(v, -128.0, 127.0).to(torch.int8)
        acc = matmul_integer(q, self.weight)
        return acc.float() * self.weight_scale * row

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.dynamic:
            y = self._per_token(x)
        else:
            if not self.input_quantized:
                x = self.x.q(x * self.smooth if self.smooth is not None else x)
            w = dequantize(self.weight, self.weight_scale, self.weight_zero_point, 1)
            x = self.x.dq(x)
            y = gemm(x, w) if x.dim() == 2 else torch.matmul(x, w)
        if self.bias is not None:
            y = y + self.bias
        if self.activation in GATED_ACTIVATIONS:
            half = y.shape[-1] // 2
            gate, up = y[..., :half], y[..., half:]
            y = ACTIVATIONS[GATED_ACTIVATIONS[self.activation]](gate) * up
        else:
            y = ACTIVATIONS[self.activation](y)
        if residual is not None:
            y = y + residual.float()
        if self.out is not None:
            return self.out.q(y)
        return y.to(self.out_dtype)


class QDQConv2d(nn.Module):
    """A ``QConv2d`` as ``[Q] -> DQ -> Conv(DQ(W), DQ(bias int32)) -> act -> [+ residual]
    -> [post-act] -> [Q]``.

    onnxruntime fuses Conv into QLinearConv only when a QuantizeLinear reads the Conv itself and
    the bias is int32 at scale ``x_scale * w_scale``: the bias is rounded to that grid (at most
    half a step, ``scale / 2``, off qfuse's float bias) and a ReLU / ReLU6 before an int8 output
    moves behind the QuantizeLinear (exact: they commute with it). Convs with a residual add or
    a float output keep the add and activation in float after a float Conv.
    """

    def __init__(self, conv, name: str, act_dtype: torch.dtype):
        super().__init__()
        self.name, self.notes = name, []
        b = {k: v for k, v in conv._buffers.items() if v is not None}
        weight = b["weight"].contiguous()
        self.qdtype = weight.dtype
        if b["x_inv_scale"].numel() > 1:
            raise UnsupportedError(
                f"layer {name}: a per-channel input prologue (SmoothQuant) on a Conv2d has no "
                "QDQ form; export without SmoothQuant on convolutions.")
        self.stride, self.padding = conv.stride, conv.padding
        self.dilation, self.groups = conv.dilation, conv.groups
        self.activation, self.post_activation = conv.activation, conv.post_activation
        self.out_dtype = conv.out_dtype
        self.input_quantized = conv.input_quantized
        self.register_buffer("weight", weight)
        s, z = _weight_dq_params(b["weight_scale"], self.qdtype)
        self.register_buffer("weight_scale", s)
        self.register_buffer("weight_zero_point", z)
        self.x = ActivationQParams(b["x_scale"], b.get("x_zero_point"), self.qdtype, act_dtype)
        bias = b.get("bias")
        self.bias_int32 = bias is not None and self.qdtype != FP8
        if self.bias_int32:
            grid = b["scale"].float().contiguous()  # x_scale * w_scale, as onnxruntime checks
            q = torch.round(bias.double() / grid.double()).clamp(-(2**31), 2**31 - 1)
            self.register_buffer("bias", q.to(torch.int32))
            self.register_buffer("bias_scale", grid)
            self.register_buffer("bias_zero_point", torch.zeros_like(q, dtype=torch.int32))
            self.notes.append(f"{name}: bias rounded to int32 at x_scale * w_scale (QLinearConv "
                              "takes it so; within half a step of qfuse's float bias)")
        else:
            self.register_buffer("bias", bias.float() if bias is not None else None)
        self.res = None
        if "residual_scale" in b:
            self.res = ActivationQParams(b["residual_scale"], b.get("residual_zero_point"),
                                         self.qdtype, act_dtype)
        self.out = None
        if self.out_dtype in (torch.int8, FP8):
            self.out = ActivationQParams(b["out_scale"], b.get("out_zero_point"), self.qdtype,
                                         act_dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.input_quantized:
            x = self.x.q(x)
        w = dequantize(self.weight, self.weight_scale, self.weight_zero_point, 0)
        bias = self.bias
        if self.bias_int32:
            bias = dequantize(bias, self.bias_scale, self.bias_zero_point, 0)
        y = F.conv2d(self.x.dq(x), w, bias, self.stride, self.padding, self.dilation, self.groups)
        clamp_after_q = (self.out is not None and residual is None and self.post_activation ==
                         "none" and self.activation in CLAMPS + ("none",))
        if clamp_after_q:
            q = self.out.q(y)
            if self.activation == "none" or (self.activation == "relu" and
                                            self.out.qmin_zero_point):
                return q
            return self.out.q(ACTIVATIONS[self.activation](self.out.dq(q)))
        y = ACTIVATIONS[self.activation](y)
        if residual is not None:
            y = y + (self.res.dq(residual) if self.res is not None else residual.float())
        y = ACTIVATIONS[self.post_activation](y)
        if self.out is not None:
            return self.out.q(y)
        return y.to(self.out_dtype)
