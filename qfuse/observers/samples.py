"""A uniform sample of a layer's input rows: what a per-layer search (SmoothQuant's migration
strength and the static activation clip, ``qfuse.algorithms.smoothquant.search``) measures a
candidate's output error on.

Ranges alone cannot rank candidates: the error of ``Q(x / s) Q(W s)^T`` against ``x W^T``
depends on how the values inside the range are spread. The sample keeps the first row of every
sequence (in a causal LM, the attention-sink token whose activations are orders of magnitude
larger than the rest and which a clipped range must still serve) and a uniform sample of the
others, drawn with a fixed seed (reservoir sampling by random keys), so its size never depends
on how much data went through.
"""

from __future__ import annotations

import torch

from qfuse.errors import CalibrationError
from qfuse.observers.base import Recorder


class InputSamples(Recorder):
    """Identity module keeping up to ``max_rows`` rows of what passes through (the last
    dimension is a row's features), the first row of each sequence always among them.

    Example:
        >>> import torch
        >>> s = InputSamples(layer_name="fc", max_rows=8)
        >>> _ = s(torch.randn(4, 16, 3))
        >>> tuple(s.rows.shape), int(s.num_rows)
        ((8, 3), 64)
    """

    def __init__(self, *, layer_name: str, max_rows: int = 512, seed: int = 0) -> None:
        super().__init__(layer_name)
        self.max_rows, self.seed = int(max_rows), int(seed)
        self.register_buffer("rows", torch.zeros(0, 0))
        self.register_buffer("keys", torch.zeros(0))
        self.register_buffer("num_rows", torch.zeros((), dtype=torch.int64))
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or not x.is_floating_point() or x.numel() == 0:
            return x
        xd = x.detach()
        self._check_finite(xd, int(self.num_batches) + 1)
        rows = xd.float().reshape(-1, xd.shape[-1])
        gen = torch.Generator().manual_seed(self.seed + int(self.num_batches))
        keys = torch.rand(rows.shape[0], generator=gen).to(rows.device)
        if xd.dim() >= 3:  # [batch, seq, features]: each sequence's first row is always kept
            keys.view(-1, xd.shape[-2])[:, 0] = 2.0
        self._keep(rows, keys)
        self.num_rows += rows.shape[0]
        self.num_batches += 1
        return x

    def _keep(self, rows: torch.Tensor, keys: torch.Tensor) -> None:
        if self.rows.numel():
            if self.rows.shape[1] != rows.shape[1]:
                raise CalibrationError(
                    f"{self.layer_name}: a calibration batch has {rows.shape[1]} features per "
                    f"row, earlier ones had {self.rows.shape[1]}. Feed batches of one layout."
                )
            rows = torch.cat([self.rows, rows.to(self.rows.device)])
            keys = torch.cat([self.keys, keys.to(self.keys.device)])
        top = keys.topk(min(self.max_rows, keys.numel())).indices.sort().values
        self.rows, self.keys = rows[top].clone(), keys[top].clone()

    def _merge_key(self) -> tuple:
        return (self.max_rows,)

    def _merge_stats(self, other: InputSamples) -> None:
        self._keep(other.rows, other.keys)
        self.num_rows += other.num_rows.to(self.num_rows.device)

    def check_calibrated(self) -> None:
        if int(self.num_rows) == 0:
            raise CalibrationError(
                f"{self.layer_name}: no calibration data reached this layer, so the SmoothQuant "
                "search has nothing to measure. Run calibration batches through the prepared "
                "model before qfuse.convert."
            )

    def extra_repr(self) -> str:
        return f"layer_name={self.layer_name!r}, max_rows={self.max_rows}"
