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

    Merging (``merge``, and across ranks ``qfuse.observers.distributed.sync``) gives the average
    one observer would hold after this observer's batches followed by the other's. The average
    is affine in where it started, ``m = decay * origin + contribution``, with
    ``decay = (1 - c)^n`` over the ``n`` batches since ``origin``; so the other's batches,
    replayed from this observer's value instead of their own origin, give
    ``m = decay_b * m_a + (m_b - decay_b * origin_b)``. A fresh observer's first batch counts as a
    step from an origin equal to that batch's range (which leaves it there), so the merge is exact
    up to float32 rounding, also against the first-batch rule. ``sync`` makes the merged value
    every rank's new origin: QAT syncing every step then equals one process that sees rank 0's
    batch, then rank 1's, and so on, each step.

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
        # Where the average started and how much of it is left (see Merging above).
        self.register_buffer("origin_min", torch.tensor(float("inf")))
        self.register_buffer("origin_max", torch.tensor(float("-inf")))
        self.register_buffer("decay", torch.ones((), dtype=torch.float64))

    def observe(self, x: torch.Tensor) -> None:
        if int(self.num_batches) == 0:
            super().observe(x)
            self.origin_min, self.origin_max = self.min_val.clone(), self.max_val.clone()
            self.decay = self.decay.new_full((), 1.0 - self.averaging_constant)
            return
        self.decay = self.decay * (1.0 - self.averaging_constant)
        if self.channel_axis is None:
            lo, hi = torch.aminmax(x)
        else:
            lo, hi = torch.aminmax(self._per_channel_view(x), dim=1)
        # Written exactly as torch.ao writes it (not as (1 - c) * min + c * lo): the float32
        # rounding then matches and the qparams agree bit for bit.
        c = self.averaging_constant
        self.min_val = self.min_val + c * (lo - self.min_val)
        self.max_val = self.max_val + c * (hi - self.max_val)

    def _merge_key(self) -> tuple:
        return (*super()._merge_key(), self.averaging_constant)

    def _merge_stats(self, other: MovingAverageMinMaxObserver) -> None:
        device = self._device()
        decay = other.decay.to(device).float()
        self.min_val = decay * self.min_val + (
            other.min_val.to(device) - decay * other.origin_min.to(device)
        )
        self.max_val = decay * self.max_val + (
            other.max_val.to(device) - decay * other.origin_max.to(device)
        )
        self.decay = self.decay * other.decay.to(device)

    def rebase(self) -> None:
        """Make the current average the origin of the batches still to come (after a sync)."""
        self.origin_min, self.origin_max = self.min_val.clone(), self.max_val.clone()
        self.decay = torch.ones_like(self.decay)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant}"
