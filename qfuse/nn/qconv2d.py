"""QConv2d: a fused int8 / fp8 Conv2d (+folded BN bias, activation, residual, requant)."""

from __future__ import annotations

import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.conv.call import ConvCall
from qfuse.kernels.conv.implicit import pack_weight
from qfuse.nn.base import QuantizedModule
from qfuse.ops.backend import eager
from qfuse.ops.qconv2d import dynamic_input_qparams, qconv2d_call
from qfuse.primitives import quantize_weight, quantize_weight_fp8


class QConv2d(QuantizedModule):
    """int8 or fp8 Conv2d through ``qfuse::qconv2d``: the Triton implicit-GEMM kernel on CUDA,
    the PyTorch reference on CPU. ``x_scale=None`` quantizes the input with a per-tensor scale
    computed from each batch (dynamic; symmetric). Weights are kept packed for the kernel
    (channels-last memory, same shape) and outputs are channels-last.

    Example:
        >>> import torch
        >>> conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        >>> q = QConv2d.from_float(conv.weight, conv.bias, stride=[1, 1], padding=[1, 1],
        ...                        dilation=[1, 1], groups=1, x_scale=torch.tensor(0.02),
        ...                        x_zero_point=None, activation="relu")
        >>> q(torch.randn(2, 4, 6, 6)).shape
        torch.Size([2, 8, 6, 6])
    """

    BUFFER_NAMES = ("weight", "weight_scale", "scale", "bias", *QuantizedModule.QPARAM_BUFFERS,
                    "residual_scale", "residual_zero_point")
    LAYOUT_FIELDS = QuantizedModule.LAYOUT_FIELDS + (
        "stride",
        "padding",
        "dilation",
        "groups",
        "post_activation",
    )

    def __init__(self, in_channels: int, out_channels: int, kernel_size, groups: int = 1) -> None:
        super().__init__()
        kh, kw = kernel_size
        self.stride, self.padding, self.dilation, self.groups = [1, 1], [0, 0], [1, 1], groups
        self.post_activation = "none"
        self._init_buffers((out_channels, in_channels // groups, kh, kw), out_channels)
        self._set_qparams("x", 1.0, None)
        self._set_qparams("out", None, None)
        self.register_buffer("residual_scale", None)  # set when the residual comes int8/fp8
        self.register_buffer("residual_zero_point", None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        stride,
        padding,
        dilation,
        groups: int,
        x_scale: torch.Tensor,
        x_zero_point: torch.Tensor | None,
        per_channel: bool = True,
        activation: str = "none",
        post_activation: str = "none",
        input_quantized: bool = False,
        out_scale: torch.Tensor | None = None,
        out_zero_point: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        dtype: torch.dtype = torch.int8,
        weight_scale: torch.Tensor | None = None,
        residual_scale: torch.Tensor | None = None,
        residual_zero_point: torch.Tensor | None = None,
    ) -> QConv2d:
        out_c, in_c_per_group, kh, kw = weight.shape
        mod = cls(in_c_per_group * groups, out_c, (kh, kw), groups)
        mod.stride, mod.padding, mod.dilation = list(stride), list(padding), list(dilation)
        if dtype not in (torch.int8, torch.float8_e4m3fn):
            raise UnsupportedError(f"QConv2d dtype {dtype}: use torch.int8 or float8_e4m3fn.")
        quantize = quantize_weight_fp8 if dtype == torch.float8_e4m3fn else quantize_weight
        q, w_scale = quantize(weight, per_channel, weight_scale)
        mod.weight, mod.weight_scale = pack_weight(q), w_scale
        if x_scale is None and (x_zero_point is not None or input_quantized):
            raise UnsupportedError(
                "QConv2d: a dynamic (x_scale=None) layer takes float input and no zero point."
            )
        mod._set_qparams("x", x_scale, x_zero_point)
        mod.scale = (mod.x_scale * w_scale if x_scale is not None else w_scale).to(torch.float32)
        mod.bias = bias.detach().float().clone() if bias is not None else None
        mod.activation = activation
        mod.post_activation = post_activation
        mod._input_quantized = input_quantized
        mod.out_dtype = out_dtype
        if out_dtype in (torch.int8, torch.float8_e4m3fn):
            mod._set_qparams("out", out_scale, out_zero_point)
        if residual_scale is not None:  # the residual arrives quantized with these qparams
            mod.residual_scale = torch.as_tensor(residual_scale, dtype=torch.float32).reshape(())
            if residual_zero_point is not None and int(residual_zero_point) != 0:
                mod.residual_zero_point = torch.as_tensor(
                    residual_zero_point, dtype=torch.int32).reshape(())
        return mod.to(weight.device)

    @property
    def triton_kernel(self) -> str:
        """Which Triton kernel runs this layer on CUDA (``qfuse.summary``'s kernel column)."""
        out_c, in_per_group = self._buffers["weight"].shape[:2]  # the quantized tensor (swap.py)
        if in_per_group == 1 and self.groups == out_c:
            return "triton depthwise conv"
        return "triton implicit-GEMM conv"

    @classmethod
    def from_layout(cls, layout: dict, tensors: dict[str, torch.Tensor]) -> QConv2d:
        # Files written before post-activation fusion have no such field: nothing after the add.
        return super().from_layout({"post_activation": "none", **layout}, tensors)

    def _post_load(self) -> None:
        self.weight = pack_weight(self.weight)  # files store plain contiguous tensors

    @property
    def dynamic(self) -> bool:
        """True when the input's per-tensor scale is computed at run time (no static scale)."""
        return self.x_inv_scale is None and not self._input_quantized

    def describe(self, **changes) -> ConvCall:
        """This layer's fused conv call (``kernels.conv.call.ConvCall``), ``changes`` (fields by
        name) applied."""
        return ConvCall(**{
            **self._call_fields("residual_scale", "residual_zero_point"),
            "stride": self.stride, "padding": self.padding, "dilation": self.dilation,
            "groups": self.groups, "post_act": self.post_activation, **changes,
        })

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.dynamic:  # this batch's scale, as device tensors into the static conv path
            x_scale, x_inv_scale = dynamic_input_qparams(x, self._buffers["weight"].dtype)
            call = self.describe(scale=self.scale * x_scale, x_inv_scale=x_inv_scale)
        else:
            call = self.layer_call() if eager(x) else self.describe()
        return qconv2d_call(x, call, residual)

    def extra_repr(self) -> str:
        return (
            f"weight={tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, "
            f"act={self.activation}, post_act={self.post_activation}, output={self.out_dtype}"
        )
