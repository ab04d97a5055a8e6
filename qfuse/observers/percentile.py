"""Percentile observer: the range that covers a given percentile of each batch, averaged."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from qfuse.errors import UnsupportedError
from qfuse.observers.base import Observer


def kth_rank(percentile: float | Fraction, n: int) -> int:
    """1-based rank of the ``percentile``-th percentile of ``n`` values (nearest-rank method).

    ``ceil(percentile / 100 * n)`` clamped to ``[1, n]``: numpy's ``method="inverted_cdf"``, the
    smallest value whose empirical CDF reaches the percentile, always an observed value. The
    percentile is taken as written, in exact decimal arithmetic: in floats, 99.99 / 100 * 10000
    is 9999.000000000002, and the binary float nearest 99.9 is a hair above it, so either would
    round up to the maximum.

    Example:
        >>> kth_rank(99.99, 10000), kth_rank(99.9, 1000), kth_rank(50, 5), kth_rank(0.0, 7)
        (9999, 999, 3, 1)
    """
    return min(max(math.ceil(Fraction(str(percentile)) * n / 100), 1), n)


class PercentileObserver(Observer):
    """Clips to the ``percentile``-th percentile of each batch, averaged over batches.

    Per batch (and per channel along ``channel_axis``):

    - symmetric: ``a`` = the ``percentile``-th percentile of ``|x|``; the range is ``[-a, a]``.
      One statistic of the magnitude, so both tails share the clipping budget.
    - affine: ``lo`` = the ``(100 - percentile)``-th and ``hi`` = the ``percentile``-th percentile
      of ``x``; each tail clips at most ``100 - percentile`` percent of the batch.

    Percentiles use the nearest-rank definition (``kth_rank``): an observed value found with
    ``torch.kthvalue``, no interpolation, so the result is deterministic and exact.

    Batches are combined by the plain mean of their per-batch ranges. The max over batches
    would let the one batch with the largest tail set the range, which is the outlier
    sensitivity this observer exists to avoid; the mean estimates the percentile of a typical
    batch and, summed in float64, does not depend on batch order beyond float64 rounding. With a
    batch of fewer than ``100 / (100 - percentile)`` values the percentile is that batch's max.

    Args:
        percentile: in (0, 100]; 100 gives the mean of the per-batch min/max.
        **kwargs: ``symmetric``, ``qmin``, ``qmax``, ``channel_axis``, ``layer_name``
            (see ``qfuse.observers.base.Observer``).

    Example:
        >>> import torch
        >>> obs = PercentileObserver(percentile=99.0, symmetric=True)
        >>> x = torch.arange(1.0, 101.0)  # 1 .. 100: the 99th percentile is 99
        >>> _ = obs(x); _ = obs(-x * 3)   # |x| 3 .. 300: the 99th percentile is 297
        >>> obs.value_range()
        (tensor(-198.), tensor(198.))
    """

    def __init__(self, *, percentile: float = 99.99, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 < percentile <= 100.0:
            raise UnsupportedError(
                f"{self.layer_name}: percentile={percentile} is outside (0, 100]. Pass the "
                "percentile in percent, e.g. 99.99 to clip the top 0.01% of values."
            )
        self.percentile = percentile
        # Sums of the per-batch ranges; value_range divides by num_batches.
        self.register_buffer("min_sum", torch.zeros((), dtype=torch.float64))
        self.register_buffer("max_sum", torch.zeros((), dtype=torch.float64))

    def observe(self, x: torch.Tensor) -> None:
        flat = x.reshape(1, -1) if self.channel_axis is None else self._per_channel_view(x)
        n = flat.shape[1]
        if self.symmetric:
            hi = flat.abs().kthvalue(kth_rank(self.percentile, n), dim=1).values
            lo = -hi
        else:
            hi = flat.kthvalue(kth_rank(self.percentile, n), dim=1).values
            # 100 - Fraction(p), not 100.0 - p: 100.0 - 99.99 is 0.010000000000005116.
            lo = flat.kthvalue(kth_rank(100 - Fraction(str(self.percentile)), n), dim=1).values
        if self.channel_axis is None:
            lo, hi = lo[0], hi[0]
        self.min_sum = self.min_sum + lo.double()
        self.max_sum = self.max_sum + hi.double()

    def _merge_key(self) -> tuple:
        return (*super()._merge_key(), self.percentile)

    def _merge_stats(self, other: PercentileObserver) -> None:
        """Sums of per-batch ranges add (and so do the batch counts): the mean over all batches,
        equal to one observer over both up to float64 summation order."""
        self.min_sum = self.min_sum + other.min_sum.to(self._device())
        self.max_sum = self.max_sum + other.max_sum.to(self._device())

    def value_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_calibrated()
        n = self.num_batches.double()
        return (self.min_sum / n).float(), (self.max_sum / n).float()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, percentile={self.percentile}"
