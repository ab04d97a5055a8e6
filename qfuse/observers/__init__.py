"""Observers by name: ``make_observer(name, **kwargs)`` builds the one a QConfig names."""

from __future__ import annotations

from qfuse.errors import UnsupportedError
from qfuse.observers.base import Observer
from qfuse.observers.histogram import (
    HistogramEntropyObserver,
    HistogramMSEObserver,
    HistogramObserver,
)
from qfuse.observers.minmax import MinMaxObserver
from qfuse.observers.moving_average import MovingAverageMinMaxObserver
from qfuse.observers.percentile import PercentileObserver

OBSERVER_REGISTRY: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "moving_average_minmax": MovingAverageMinMaxObserver,
    "percentile": PercentileObserver,
    "histogram": HistogramObserver,
    "histogram_mse": HistogramMSEObserver,
    "histogram_entropy": HistogramEntropyObserver,
}


def make_observer(name: str, **kwargs) -> Observer:
    """An observer of the registered kind ``name`` (see ``OBSERVER_REGISTRY``)."""
    try:
        cls = OBSERVER_REGISTRY[name]
    except KeyError:
        raise UnsupportedError(
            f"observer {name!r} unknown; choose one of {sorted(OBSERVER_REGISTRY)}."
        ) from None
    return cls(**kwargs)


__all__ = [
    "OBSERVER_REGISTRY",
    "HistogramEntropyObserver",
    "HistogramMSEObserver",
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "PercentileObserver",
    "make_observer",
]
