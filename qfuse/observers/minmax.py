"""MinMax observer: the running minimum and maximum, per tensor or per channel."""

from __future__ import annotations

import torch

from qfuse.observers.base import Observer


class MinMaxObserver(Observer):
    """Records the smallest and largest value seen (torch.ao's MinMaxObserver semantics).

    Example:
        >>> import torch
        >>> obs = MinMaxObserver(symmetric=True)
        >>> _ = obs(torch.tensor([-1.0, 0.5])); _ = obs(torch.tensor([2.55]))
        >>> scale, zp = obs.calculate_qparams()
        >>> round(scale.item(), 6), zp.item()
        (0.02, 0)
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def observe(self, x: torch.Tensor) -> None:
        if self.channel_axis is None:
            lo, hi = torch.aminmax(x)
        else:
            lo, hi = torch.aminmax(self._per_channel_view(x), dim=1)
        if int(self.num_batches) == 0:
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val = torch.minimum(self.min_val, lo)
            self.max_val = torch.maximum(self.max_val, hi)

    def value_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val

    def _merge_stats(self, other: MinMaxObserver) -> None:
        """The smaller minimum and the larger maximum: exactly one observer over both."""
        self.min_val = torch.minimum(self.min_val, other.min_val.to(self._device()))
        self.max_val = torch.maximum(self.max_val, other.max_val.to(self._device()))
