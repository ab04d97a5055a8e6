"""The second moment of a layer's input, ``H = E[x x^T]``: the statistic GPTQ rounds weights by.

A Linear's input rows are its last dimension; a Conv2d's are its unfolded patches
(``F.unfold`` orders them channel-major, the order of ``weight.reshape(out_channels, -1)``).
``H`` is a running mean in float32 (``H_n+m = n/(n+m) H_n + X^T X / (n+m)``), so its size never
depends on how much data went through and the sum never overflows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qfuse.errors import CalibrationError
from qfuse.observers.base import Recorder


class InputHessian(Recorder):
    """Identity module accumulating ``E[x x^T]`` over the rows of what passes through.

    Args:
        layer_name: the layers reading this input (error messages name them).
        conv: ``None`` for Linear rows, else ``dict(kernel_size, stride, padding, dilation)``
            of the Conv2d whose patches are the rows.

    Example:
        >>> import torch
        >>> h = InputHessian(layer_name="fc")
        >>> x = torch.randn(64, 8)
        >>> _ = h(x)
        >>> torch.allclose(h.hessian, x.T @ x / 64, atol=1e-5), int(h.num_rows)
        (True, 64)
    """

    def __init__(self, *, layer_name: str, conv: dict | None = None) -> None:
        super().__init__(layer_name)
        self.conv = dict(conv) if conv is not None else None
        self.register_buffer("hessian", torch.zeros(0, 0))
        self.register_buffer("num_rows", torch.zeros((), dtype=torch.int64))
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.int64))
        # GPTQ's results for the current H (qfuse.algorithms.gptq); new data clears it
        self.solved: dict = {}

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is None:
            return x.reshape(-1, x.shape[-1])
        if x.dim() != 4:
            raise CalibrationError(
                f"{self.layer_name}: a Conv2d input must be NCHW, got shape {tuple(x.shape)}."
            )
        patches = F.unfold(x, **self.conv)  # [N, C*kh*kw, L]
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or not x.is_floating_point() or x.numel() == 0:
            return x
        xd = x.detach()
        self._check_finite(xd, int(self.num_batches) + 1)
        rows = self._rows(xd.float())
        n, m, k = int(self.num_rows), rows.shape[0], rows.shape[1]
        if n == 0:
            self.hessian = torch.zeros(k, k, device=rows.device, dtype=torch.float32)
        elif self.hessian.shape[0] != k:
            raise CalibrationError(
                f"{self.layer_name}: a calibration batch has {k} input features per row, earlier "
                f"ones had {self.hessian.shape[0]}. Feed batches of the same layout."
            )
        self.hessian.mul_(n / (n + m)).addmm_(rows.T, rows, alpha=1.0 / (n + m))
        self.num_rows += m
        self.num_batches += 1
        self.solved.clear()
        return x

    def _merge_key(self) -> tuple:
        return (self.conv,)

    def _check_mergeable(self, other: InputHessian) -> None:
        if other.hessian.shape != self.hessian.shape:
            raise CalibrationError(
                f"{self.layer_name}: cannot merge a {tuple(other.hessian.shape)} input Hessian "
                f"into a {tuple(self.hessian.shape)} one: every process must calibrate the same "
                "model."
            )

    def _merge_stats(self, other: InputHessian) -> None:
        """The row-weighted mean ``(n_a H_a + n_b H_b) / (n_a + n_b)``: one running mean over
        both sides' rows, up to float32 rounding."""
        n, m = int(self.num_rows), int(other.num_rows)
        self.hessian.mul_(n / (n + m)).add_(
            other.hessian.to(self.hessian.device), alpha=m / (n + m)
        )
        self.num_rows += m

    def _after_merge(self) -> None:
        self.solved.clear()

    def check_calibrated(self) -> None:
        if int(self.num_rows) == 0:
            raise CalibrationError(
                f"{self.layer_name}: no calibration data reached this layer, so GPTQ has no input "
                "statistics. Run calibration batches through the prepared model before "
                "qfuse.convert, or leave the layer out of GPTQ(layers=...)."
            )

    def extra_repr(self) -> str:
        return f"layer={self.layer_name}, rows={int(self.num_rows)}"
