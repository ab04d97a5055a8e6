"""QLinear4: a Linear with 4-bit group-quantized weights (W4A16 or W4A8) as a module."""

from __future__ import annotations

import torch

from qfuse import int4
from qfuse.errors import UnsupportedError
from qfuse.kernels.common import out_features as gemm_columns
from qfuse.nn.base import QuantizedModule
from qfuse.ops.w4linear import W4Call, w4linear


class QLinear4(QuantizedModule):
    """``y = act(x @ W4^T + bias) [+ residual]`` with 4-bit weights in groups along K.

    ``weight`` holds the codes packed eight to an int32 (``qfuse.int4``), ``weight_scale``
    [N, G] and ``weight_zero_point`` [N, G] (asymmetric only) the group qparams. ``act_bits``
    16 runs float activations (W4A16); 8 quantizes them to int8 (W4A8) with ``x_scale`` (static)
    or per token (no ``x_scale``). Output is float in the input's dtype.

    Example:
        >>> import torch
        >>> w, x = torch.randn(16, 40), torch.randn(4, 40)
        >>> lin = QLinear4.from_float(w, None, group_size=8, symmetric=False)
        >>> err = (lin(x) - x @ w.t()).norm() / (x @ w.t()).norm()
        >>> lin.weight.dtype, tuple(lin.weight.shape), tuple(lin.weight_scale.shape)
        (torch.int32, (16, 5), (16, 5))
        >>> bool(err < 0.1)
        True
    """

    LAYOUT_FIELDS = QuantizedModule.LAYOUT_FIELDS + ("in_features", "group_size", "act_bits")
    BUFFER_NAMES = ("weight", "weight_scale", "weight_zero_point", "bias", "x_scale",
                    "x_inv_scale")
    triton_kernel = "triton w4 gemm"

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        group_size: int | None = 128,
        symmetric: bool = True,
        act_bits: int = 16,
        x_scale: torch.Tensor | None = None,
        activation: str = "none",
        qparams: tuple | None = None,
        name: str = "<layer>",
    ) -> QLinear4:
        """Round ``weight`` [N, K] to 4 bits in groups of ``group_size`` (None: per channel).
        ``qparams`` (scale, zero) replaces the round-to-nearest group qparams (GPTQ rounds
        against its own); ``x_scale`` gives a W4A8 layer a static input scale."""
        int4.check_group_size(group_size, f"layer {name}: group_size")
        if act_bits not in (8, 16):
            raise UnsupportedError(f"layer {name}: act_bits={act_bits}; use 16 (W4A16) or 8 "
                                   "(W4A8).")
        if weight.dim() != 2:
            raise UnsupportedError(
                f"layer {name}: 4-bit weights cover Linear layers ({tuple(weight.shape)} given); "
                "keep convolutions float (convert(keep_float=...)) or quantize them to int8.")
        w = weight.detach().float()
        scale, zero = qparams if qparams is not None else int4.group_qparams(w, group_size,
                                                                             symmetric)
        q = int4.quantize_groups(w, scale, zero, group_size)
        mod = cls.__new__(cls)
        torch.nn.Module.__init__(mod)
        mod.activation, mod.out_dtype, mod._input_quantized = activation, torch.float32, False
        mod.in_features, mod.group_size, mod.act_bits = w.shape[1], group_size, act_bits
        mod.register_buffer("weight", int4.pack(q))
        mod.register_buffer("weight_scale", scale.float().contiguous())
        mod.register_buffer("weight_zero_point", zero.to(torch.int8) if zero is not None else None)
        mod.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)
        if x_scale is not None and act_bits == 16:
            raise UnsupportedError(f"layer {name}: a W4A16 layer takes no input scale.")
        if x_scale is not None:
            s = torch.as_tensor(x_scale, dtype=torch.float32).reshape(())
            mod.register_buffer("x_scale", s)
            mod.register_buffer("x_inv_scale", torch.reciprocal(s))
        else:
            mod.register_buffer("x_scale", None)
            mod.register_buffer("x_inv_scale", None)
        mod._post_load()
        return mod.to(weight.device)

    @staticmethod
    def stored_weight_shape(float_shape: tuple) -> tuple:
        """The packed ``weight`` buffer's shape for a float weight of ``float_shape``."""
        return (float_shape[0], -(-float_shape[1] // int4.PER_WORD))

    def _post_load(self) -> None:
        self.out_features = gemm_columns(self.weight.shape[0], self.activation)

    def rows(self, start: int, end: int | None, step: int = 1) -> QLinear4:
        """The layer of output rows ``start:end:step`` (a merged layer split back into its
        members), buffers copied."""
        per_row = ("weight", "weight_scale", "weight_zero_point", "bias")
        buffers = {k: (v[start:end:step] if k in per_row else v).clone()
                   for k, v in self._buffers.items() if v is not None}
        return QLinear4.from_layout(self.layout(), buffers)

    @property
    def out_scale(self) -> None:
        """4-bit layers write float (no requantized output)."""
        return None

    @property
    def dynamic(self) -> bool:
        return self.act_bits == 8 and self.x_scale is None

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight the layer computes with (export, checks)."""
        # the buffer: a layer swapped into a user's model reports an empty float ``weight``
        q = int4.unpack(self._buffers["weight"], self.in_features)
        return int4.dequantize_groups(q, self.weight_scale, self.weight_zero_point,
                                      self.group_size)

    def describe(self) -> W4Call:
        b = self._buffers
        return W4Call(b["weight"], b["weight_scale"], b["weight_zero_point"], b["bias"],
                      self.in_features, self.group_size, self.activation, self.act_bits,
                      b["x_scale"], b["x_inv_scale"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return w4linear(x, self.layer_call(), residual)

    def facing_weight(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.float32, device=self._buffers["weight"].device)

    def extra_repr(self) -> str:
        kind = "w4a16" if self.act_bits == 16 else ("w4a8, dynamic per-token" if self.dynamic
                                                    else "w4a8")
        group = self.group_size or "channel"
        zp = "asymmetric" if self.weight_zero_point is not None else "symmetric"
        return (f"{kind}, group={group}, {zp}, in={self.in_features}, out={self.out_features}, "
                f"act={self.activation}")
