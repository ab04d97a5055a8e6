"""QConv1d: ``nn.Conv1d`` as a height-1 ``QConv2d`` (Whisper and wav2vec2 front-ends)."""

from __future__ import annotations

import torch
from torch import nn

from qfuse.nn.qconv2d import QConv2d


class QConv1d(nn.Module):
    """Runs ``conv`` (a ``QConv2d`` with a ``[out, in, 1, k]`` weight) on ``x[:, :, None, :]``.

    Example:
        >>> import torch
        >>> w = torch.randn(4, 3, 1, 5)
        >>> conv = QConv2d.from_float(w, None, stride=[1, 1], padding=[0, 2], dilation=[1, 1],
        ...                           groups=1, x_scale=torch.tensor(0.05), x_zero_point=None)
        >>> y = QConv1d(conv)(torch.randn(2, 3, 9))
        >>> tuple(y.shape)
        (2, 4, 9)
    """

    def __init__(self, conv: QConv2d) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(2)).squeeze(2)
