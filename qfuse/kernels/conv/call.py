"""The fused convolution's call, described once: ``ConvCall``, as ``gemm.call.GemmCall`` is the
GEMM's: a layer's weight, scales, bias, zero points, geometry, activations and output dtype,
built once per layer (``nn.QConv2d``) and read with the per-call tensors ``x`` and ``residual``
beside it by the kernels (``implicit.qconv2d`` and the paths it routes to), the traced op's
body (``ops.qconv2d``) and the CPU reference (``ops.reference.qconv2d``). ``OP_ARGS`` is the
``qfuse::qconv2d`` schema (``qfuse::tma_conv1x1`` appends its own arguments).

Example:
    >>> import torch
    >>> call = ConvCall(torch.ones(8, 4, 3, 3, dtype=torch.int8), torch.ones(8),
    ...                 padding=[1, 1], act="relu")
    >>> call.output_shape((2, 4, 6, 6))
    (2, 8, 6, 6)
    >>> x, again, residual = ConvCall.from_op_args(*call.op_args(torch.ones(2, 4, 6, 6)))
    >>> again.padding, again.act, residual
    ([1, 1], 'relu', None)
"""

from __future__ import annotations

import dataclasses

import torch

from qfuse.kernels.gemm.call import INPUT_ARGS, OUTPUT_ARGS, OpArg, OpArgs, QuantizedCall
from qfuse.kernels.layout import empty_nhwc


def output_size(h, w, kernel, stride, padding, dilation) -> tuple[int, int]:
    """A convolution's output height and width."""
    oh = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    return oh, ow


@dataclasses.dataclass(frozen=True, eq=False)
class ConvCall(QuantizedCall):
    """What one layer's fused conv calls are made of, besides ``x`` and ``residual``.

    ``weight`` int8 or fp8 [O, I/groups, KH, KW] (packed channels-last: ``implicit.pack_weight``);
    ``x_inv_scale`` per tensor; the geometry (``stride``, ``padding``, ``dilation``, ``groups``);
    ``act`` runs before the residual add, ``post_act`` after it; ``residual_scale`` /
    ``residual_zero_point``: the qparams of an int8/fp8 residual (``(r - zp) * scale`` is
    added). The rest as ``gemm.call.QuantizedCall``.
    """

    stride: list[int] = dataclasses.field(default_factory=lambda: [1, 1])
    padding: list[int] = dataclasses.field(default_factory=lambda: [0, 0])
    dilation: list[int] = dataclasses.field(default_factory=lambda: [1, 1])
    groups: int = 1
    post_act: str = "none"
    residual_scale: torch.Tensor | None = None
    residual_zero_point: torch.Tensor | None = None

    def output_shape(self, x_shape) -> tuple[int, int, int, int]:
        """[N, O, OH, OW] of the output for an input of ``x_shape`` [N, C, H, W]."""
        n, _, h, w = x_shape
        oh, ow = output_size(h, w, self.weight.shape[2:], self.stride, self.padding,
                             self.dilation)
        return n, self.weight.shape[0], oh, ow

    def residual_qparams(self, residual: torch.Tensor | None) -> tuple:
        """``(residual_scale, residual_zero_point)`` for a call with ``residual`` (None, None
        without one): what the op is handed and the kernels read."""
        if residual is None:
            return None, None
        return self.residual_scale, self.residual_zero_point

    def op_args(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple:
        """The ``qfuse::qconv2d`` op's flat arguments for this call."""
        scale, zero_point = self.residual_qparams(residual)
        return OP_ARGS.flatten(self, {"x": x, "residual": residual, "residual_scale": scale,
                                      "residual_zero_point": zero_point})

    @staticmethod
    def from_op_args(*args, **kwargs) -> tuple:
        """``(x, call, residual)`` from ``qfuse::qconv2d``'s arguments."""
        call, (x, residual) = OP_ARGS.unflatten(args, kwargs)
        return x, call, residual


# ``qfuse::qconv2d``'s schema, argument by argument, in the order ops.qconv2d has always taken
# them (its input and output arguments named as the GEMM's).
OP_ARGS = OpArgs(ConvCall, (
    *INPUT_ARGS,
    OpArg("residual", "Tensor?"),
    *OUTPUT_ARGS,
    *(OpArg(name, "SymInt[]", field=name) for name in ("stride", "padding", "dilation")),
    OpArg("groups", "SymInt", field="groups"),
    OpArg("post_activation", "str", "none", field="post_act"),
    *(OpArg(name, "Tensor?", None, field=name)
      for name in ("residual_scale", "residual_zero_point")),
))


def fake_output(*args, **kwargs) -> torch.Tensor:
    """The output a ``qfuse::qconv2d``-shaped op returns, from its arguments' shapes alone (its
    fake tensor): channels-last [N, O, OH, OW] of the call's ``out_dtype``."""
    x, call, _ = ConvCall.from_op_args(*args, **kwargs)
    return empty_nhwc(call.output_shape(x.shape), call.out_dtype, x.device)
