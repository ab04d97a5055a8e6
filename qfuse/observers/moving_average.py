"""Moving-average MinMax observer: an exponential moving average of each batch's min and max."""

from __future__ import annotations

import torch

from qfuse.errors import UnsupportedError
from qfuse.observers.minmax import MinMaxObserver


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of the batch min/max (torch.ao's semantics, bit for bit).

    The first batch sets the range; each later batch moves it a fraction ``c`` of the way:
    ``min = min + c * (batch_min - min)`` (same for max). One outlier batch therefore shifts the
    range by ``c`` of its excess instead of setting it, which is what makes this the usual
    observer for QAT and for activations with rare spikes. Per tensor, or per slice along
    ``channel_axis`` (torch.ao's ``MovingAveragePerChannelMinMaxObserver``).

    Args:
        averaging_constant: ``c`` in (0, 1]; 1 keeps only the last batch. torch.ao's default 0.01.
        **kwargs: ``symmetric``, ``qmin``, ``qmax``, ``channel_axis``, ``layer_name``
            (see ``qfuse.observers.base.Observer``).

    Example:
        >>> import torch
        >>> obs = MovingAverageMinMaxObserver(averaging_constant=0.5, symmetric=False)
        >>> _ = obs(torch.tensor([0.0, 2.0])); _ = obs(torch.tensor([0.0, 4.0]))
        >>> obs.value_range()
        (tensor(0.), tensor(3.))
    """

    def __init__(self, *, averaging_constant: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 < averaging_constant <= 1.0:
            raise UnsupportedError(
                f"{self.layer_name}: averaging_constant={averaging_constant} is outside (0, 1]. "
                "Use a small positive fraction such as the default 0.01 (1 keeps the last batch)."
            )
        self.averaging_constant = averaging_constant

    def observe(self, x: torch.Tensor) -> None:
        if int(self.num_batches) == 0:
            super().observe(x)
            return
        if self.channel_axis is None:
            lo, hi = torch.aminmax(x)
        else:
            lo, hi = torch.aminmax(self._per_channel_view(x), dim=1)
        # Written exactly as torch.ao writes it (not as (1 - c) * min + c * lo): the float32
        # rounding then matches and the qparams agree bit for bit.
        c = self.averaging_constant
        self.min_val = self.min_val + c * (lo - self.min_val)
        self.max_val = self.max_val + c * (hi - self.max_val)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant}"
