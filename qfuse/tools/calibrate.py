"""Prepared-and-calibrated models, cached by what determines them, with a progress bar.

The sweep's presets and ``qfuse.search`` ask for the same calibrations (``int8_static`` is the
search's first candidate), and ``auto_fallback`` converts one prepared model many times, so each
(config, SmoothQuant, GPTQ) combination is calibrated once per sweep.
"""

from __future__ import annotations

import json

import torch

from qfuse.algorithms.gptq import GPTQ
from qfuse.algorithms.smoothquant import SmoothQuant
from qfuse.analysis.sensitivity import call, split_batch
from qfuse.config import QConfig
from qfuse.flows.prepare import prepare
from qfuse.progress import progress


def key_of(config: QConfig, smoothquant: float | None, gptq: bool,
           smoothquant_layers: tuple[str, ...] | None = None) -> str:
    key = [config.to_dict(), smoothquant, gptq]
    if smoothquant is not None and smoothquant_layers is not None:
        key.append(list(smoothquant_layers))
    return json.dumps(key, sort_keys=True)


class Calibrations:
    """``get(config, smoothquant=alpha, gptq=bool, smoothquant_layers=globs)`` -> a calibrated
    ``qfuse.prepare`` result (``smoothquant_layers`` None: SmoothQuant's default layers).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
        >>> cache = Calibrations(model, [torch.randn(4, 8)], quiet=True)
        >>> a = cache.get(qfuse.QConfig.int8_static())
        >>> cache.get(qfuse.QConfig()) is a, cache.calibrations
        (True, 1)
    """

    def __init__(
        self, model, batches: list, prepare_kwargs: dict | None = None, quiet: bool = False
    ):
        self.model, self.batches, self.quiet = model, list(batches), quiet
        self.prepare_kwargs = dict(prepare_kwargs or {})
        self._cache: dict[str, torch.nn.Module] = {}
        self.calibrations = 0

    @torch.no_grad()
    def get(self, config: QConfig, smoothquant: float | None = None, gptq: bool = False,
            smoothquant_layers: tuple[str, ...] | None = None):
        key = key_of(config, smoothquant, gptq, smoothquant_layers)
        if key not in self._cache:
            args, kwargs = split_batch(self.batches[0])
            extra = dict(self.prepare_kwargs)
            if smoothquant is not None:
                extra["smoothquant"] = SmoothQuant(smoothquant, layers=smoothquant_layers)
            if gptq:
                extra["gptq"] = GPTQ()
            prepared = prepare(self.model, config, args, example_kwargs=kwargs or None, **extra)
            for batch in progress(self.batches, "calibrating", self.quiet):
                call(prepared, batch)
            self._cache[key] = prepared
            self.calibrations += 1
        return self._cache[key]

    def keep_only(self, keys: set[str]) -> None:
        """Drop cached models not in ``keys`` (a MiniLM prepared with GPTQ holds ~0.2 GB)."""
        for key in list(self._cache):
            if key not in keys:
                del self._cache[key]
