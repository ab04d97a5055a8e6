"""QLinear: a fused int8 / fp8 Linear (+bias, activation, residual, requant) as a module."""

from __future__ import annotations

import torch

from qfuse.errors import UnsupportedError
from qfuse.kernels.common import out_features as gemm_columns
from qfuse.kernels.gemm.call import GemmCall
from qfuse.nn.base import QuantizedModule
from qfuse.ops.backend import eager
from qfuse.ops.qlinear import qlinear_call, qlinear_eager_call
from qfuse.ops.reference import FP8
from qfuse.primitives import quantize_weight, quantize_weight_fp8


class QLinear(QuantizedModule):
    """``y = [requant](act(x @ W^T * scale + bias) [+ residual])`` with int8 or fp8 W, via
    ``qfuse::qlinear``.

    Build with ``QLinear.from_float``; the forward is one call into the custom op. Without an
    ``x_scale`` the activation is quantized per token at run time (dynamic).

    Example:
        >>> import torch
        >>> w, x = torch.randn(16, 32), torch.randn(4, 32)
        >>> lin = QLinear.from_float(w, None, x_scale=None, x_zero_point=None,
        ...                          dtype=torch.float8_e4m3fn, activation="relu")
        >>> y = lin(x)
        >>> err = (y - torch.relu(x @ w.t())).norm() / torch.relu(x @ w.t()).norm()
        >>> lin.weight.dtype, lin.dynamic, bool(err < 0.1)
        (torch.float8_e4m3fn, True, True)
    """

    LAYOUT_FIELDS = QuantizedModule.LAYOUT_FIELDS + ("exact_epilogue",)
    LAYOUT_DEFAULTS = {"exact_epilogue": False}

    BUFFER_NAMES = ("weight", "weight_scale", "scale", "bias", "weight_sum",
                    *QuantizedModule.QPARAM_BUFFERS)

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # GELU/SiLU epilogue on the GPU: hardware erf/exp (False) or the IEEE-exact polynomials
        # that match the CPU reference bit for bit (True). See kernels/common.activation.
        self.exact_epilogue = False
        self._launch_cache: dict = {}  # kernels.gemm.eager.qlinear_eager's plans, per M bucket
        self._init_buffers((out_features, in_features), out_features)
        self.register_buffer("weight_sum", None)
        self._set_qparams("x", 1.0, None)
        self._set_qparams("out", None, None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        x_scale: torch.Tensor | None,
        x_zero_point: torch.Tensor | None,
        dtype: torch.dtype = torch.int8,
        per_channel: bool = True,
        activation: str = "none",
        input_quantized: bool = False,
        out_scale: torch.Tensor | None = None,
        out_zero_point: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
        weight_scale: torch.Tensor | None = None,
    ) -> QLinear:
        """Quantize ``weight`` (symmetric ``dtype``: int8 or float8_e4m3fn) and fold a static
        ``x_scale`` into the per-channel scale; ``x_scale=None`` quantizes activations per token
        at run time (dynamic; no zero point).

        ``out_dtype`` int8 / float8_e4m3fn requantizes the output with ``out_scale`` (and
        ``out_zero_point`` for int8) — the next layer's static input scale. ``weight_scale``
        (one per output channel) replaces the amax scale: GPTQ rounds against a fixed scale.
        """
        if dtype not in (torch.int8, FP8):
            raise UnsupportedError(f"QLinear dtype {dtype}: use torch.int8 or float8_e4m3fn.")
        if x_scale is None and (x_zero_point is not None or input_quantized):
            raise UnsupportedError(
                "QLinear: a dynamic (x_scale=None) layer takes float input and no zero point."
            )
        mod = cls(weight.shape[1], gemm_columns(weight.shape[0], activation))
        quantize = quantize_weight_fp8 if dtype == FP8 else quantize_weight
        q, w_scale = quantize(weight, per_channel, weight_scale)
        mod.weight = q
        mod.weight_scale = w_scale
        mod._set_qparams("x", x_scale, x_zero_point)
        mod.scale = (mod.x_scale * w_scale if x_scale is not None else w_scale).to(torch.float32)
        mod.bias = bias.detach().float().clone() if bias is not None else None
        if mod.x_zero_point is not None:
            mod.weight_sum = q.sum(dim=1, dtype=torch.int32)
            mod._fold_zero_point()
        mod.activation = activation
        mod._input_quantized = input_quantized
        mod.out_dtype = out_dtype
        if out_dtype in (torch.int8, FP8):
            mod._set_qparams("out", out_scale, out_zero_point)
        return mod.to(weight.device)

    def rows(self, start: int, end: int | None, step: int = 1) -> QLinear:
        """The layer of output channels ``start:end:step`` (a merged Q/K/V layer split back into
        its members for ``convert(output="model")``; step 2: a merged gate/up layer's
        interleaved halves): per-channel buffers sliced, the rest copied (no shared storage:
        ``save_pretrained`` refuses tensors shared between modules)."""
        per_channel = ("weight", "weight_scale", "scale", "bias", "weight_sum")
        buffers = {k: (v[start:end:step] if k in per_channel else v).clone()
                   for k, v in self._buffers.items() if v is not None}
        mod = QLinear.from_layout(self.layout(), buffers)
        mod._post_load()
        return mod

    def _post_load(self) -> None:
        rows, self.in_features = self.weight.shape
        self.out_features = gemm_columns(rows, self.activation)
        self._launch_cache = {}
        self._fold_zero_point()  # files written before the fold carry weight_sum

    def _fold_zero_point(self) -> None:
        """Fold the asymmetric input's correction ``- zp_x * colsum(W) * scale`` into ``bias``
        (computed in float64, stored float32) and drop ``weight_sum``.

        The GEMM then runs the symmetric epilogue: subtracting ``zp_x * colsum(W)`` from the
        int32 accumulator tile in the epilogue made the int8 FFN-up kernel of BERT-base (GELU +
        requant, 128x128 tile) run about half as long again inside the model as the same
        schedule without zero points (H200). The output moves by float32 rounding only
        (``acc * scale`` and the folded bias round separately); the Triton kernels and the CPU
        reference compute the same folded form, bit for bit.
        """
        wsum, zp = self._buffers.get("weight_sum"), self._buffers.get("x_zero_point")
        if wsum is None or zp is None:
            return
        corr = (zp.double() * wsum.double()) * self.scale.double()
        bias = self._buffers.get("bias")
        bias = bias.double() if bias is not None else torch.zeros_like(corr)
        self.bias = (bias - corr).float()
        self.weight_sum = None

    @property
    def dynamic(self) -> bool:
        """True when activations are quantized per token at run time."""
        return self.x_inv_scale is None and not self._input_quantized

    def describe(self) -> GemmCall:
        """This layer's fused GEMM call (``kernels.gemm.call.GemmCall``): its buffers, activation
        and output dtype; the fast GELU/SiLU epilogue on CUDA unless ``exact_epilogue``."""
        fields = self._call_fields("weight_sum")
        return GemmCall(**fields, fast_act=not self.exact_epilogue and fields["weight"].is_cuda)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if eager(x):  # plain inference: the kept description, the cached launches
            return qlinear_eager_call(x, self.layer_call(), None, residual, self._launch_cache)
        return qlinear_call(x, self.describe(), None, residual)

    @property
    def launch_mode(self) -> str:
        """How the eager CUDA path launches: cached compiled kernels, or why it does not."""
        return self._launch_cache.get("plain", "cached launch")

    def extra_repr(self) -> str:
        qname = "fp8" if self.weight.dtype == FP8 else "int8"
        src = qname if self._input_quantized else "float"
        if self.dynamic:
            src += ", dynamic per-token"
        return (
            f"{qname}, in={self.in_features}, out={self.out_features}, act={self.activation}, "
            f"input={src}, output={self.out_dtype}"
        )
