"""QLinear: a fused int8 Linear (+bias, activation, residual, requant) as a module."""

from __future__ import annotations

import torch

from qfuse.nn.base import QuantizedModule
from qfuse.primitives import quantize_weight


class QLinear(QuantizedModule):
    """``y = [requant](act(x @ W^T * scale + bias) [+ residual])`` with int8 W, via ``qfuse::qlinear``.

    Build with ``QLinear.from_float``; the forward is one call into the custom op.
    """

    BUFFER_NAMES = ("weight", "weight_scale", "scale", "bias", "weight_sum", "x_scale",
                    "x_inv_scale", "x_zero_point", "out_scale", "out_inv_scale", "out_zero_point")

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation = "none"
        self.out_dtype = torch.float32
        self._input_quantized = False
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("scale", torch.ones(out_features))
        self.register_buffer("bias", None)
        self.register_buffer("weight_sum", None)
        self._set_qparams("x", 1.0, None)
        self._set_qparams("out", None, None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        x_scale: torch.Tensor,
        x_zero_point: torch.Tensor | None,
        per_channel: bool = True,
        activation: str = "none",
        input_quantized: bool = False,
        out_scale: torch.Tensor | None = None,
        out_zero_point: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> QLinear:
        """Quantize ``weight`` (symmetric int8) and fold ``x_scale`` into the per-channel scale.

        ``out_dtype=torch.int8`` requantizes the output with ``out_scale``/``out_zero_point``.
        """
        mod = cls(weight.shape[1], weight.shape[0])
        q, w_scale = quantize_weight(weight, per_channel)
        mod.weight = q
        mod.weight_scale = w_scale
        mod._set_qparams("x", x_scale, x_zero_point)
        mod.scale = (mod.x_scale * w_scale).to(torch.float32)
        mod.bias = bias.detach().float().clone() if bias is not None else None
        if mod.x_zero_point is not None:
            mod.weight_sum = q.sum(dim=1, dtype=torch.int32)
        mod.activation = activation
        mod._input_quantized = input_quantized
        mod.out_dtype = out_dtype
        if out_dtype == torch.int8:
            mod._set_qparams("out", out_scale, out_zero_point)
        return mod.to(weight.device)

    def _post_load(self) -> None:
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.qfuse.qlinear(
            x, self.weight, self.scale, self.bias, self.x_inv_scale, self.x_zero_point,
            self.weight_sum, residual, self.out_inv_scale, self.out_zero_point, self.activation,
            self.out_dtype,
        )

    def extra_repr(self) -> str:
        src = "int8" if self._input_quantized else "float"
        return (
            f"in={self.in_features}, out={self.out_features}, act={self.activation}, "
            f"input={src}, output={self.out_dtype}"
        )
