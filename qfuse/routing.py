"""Speed-aware routing: per layer, fused int8 kernel or float (bf16 cuBLAS), by a cost model.

The model predicts a layer's time from its GEMM shape (M tokens x K -> N). It prefers measured
timings of the current GPU (``CostModel.measure`` times both implementations with
``triton.testing.do_bench`` and caches them on disk per GPU name and shape); without them it uses
the analytic roofline ``max(2MNK / rate, bytes / bandwidth) + launch`` with rates measured on an
H200 (shared/ANCHORS.md) and a tile-occupancy factor, so a tiny GEMM — where the int8 kernel's
halved bytes and doubled rate cannot pay for its padded tiles and launch — stays float.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qfuse.errors import QFuseError
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.state import get_state

IMPLS = ("int8", "bf16")


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates. Defaults: measured on an H200 (ANCHORS.md: cuBLAS bf16 694 TFLOP/s,
    Triton int8 1096 TOPS, 4.2 TB/s copy); launch costs are typical eager-mode figures."""

    name: str = "NVIDIA H200"
    bf16_tflops: float = 694.0
    int8_tops: float = 1096.0
    hbm_tbps: float = 4.2
    launch_us: dict = field(default_factory=lambda: {"bf16": 4.0, "int8": 6.0})
    tile: dict = field(default_factory=lambda: {"bf16": 64, "int8": 64})


def _occupancy(M: int, N: int, tile: int) -> float:
    """Useful fraction of the tiles a GEMM launches (M and N padded up to whole tiles)."""
    pad = lambda d: math.ceil(d / tile) * tile  # noqa: E731
    return (M * N) / (pad(M) * pad(N))


def analytic_us(impl: str, M: int, K: int, N: int, rates: DeviceRates) -> float:
    """Roofline time in microseconds of one fused layer (input read, weights read, output write)."""
    flops = 2.0 * M * N * K
    if impl == "bf16":
        rate, nbytes = rates.bf16_tflops * 1e12, 2 * (M * K + N * K + M * N)
    elif impl == "int8":
        # float (bf16) input read once in the prologue, int8 weights, bf16 output
        rate, nbytes = rates.int8_tops * 1e12, 2 * M * K + N * K + 2 * M * N
    else:
        raise QFuseError(f"unknown implementation {impl!r}; choose one of {IMPLS}.")
    rate *= _occupancy(M, N, rates.tile[impl])
    return max(flops / rate, nbytes / (rates.hbm_tbps * 1e12)) * 1e6 + rates.launch_us[impl]


def _key(impl: str, M: int, K: int, N: int) -> str:
    return f"{impl}:{M}x{K}x{N}"


class CostModel:
    """Predicts per-layer time; measured timings (if any) override the analytic model."""

    def __init__(self, rates: DeviceRates | None = None, measured: dict | None = None) -> None:
        self.rates = rates or DeviceRates()
        self.measured = dict(measured or {})

    def predict_us(self, impl: str, M: int, K: int, N: int) -> tuple[float, str]:
        """(microseconds, "measured" | "analytic")."""
        key = _key(impl, M, K, N)
        if key in self.measured:
            return self.measured[key], "measured"
        return analytic_us(impl, M, K, N, self.rates), "analytic"

    # -- measured timings, cached per GPU ------------------------------------------------------
    @staticmethod
    def cache_path(device_name: str) -> Path:
        root = Path(os.environ.get("QFUSE_CACHE", Path.home() / ".cache" / "qfuse"))
        return root / f"costs-{device_name.replace(' ', '_')}.json"

    @classmethod
    def load(cls, device_name: str, rates: DeviceRates | None = None) -> CostModel:
        path = cls.cache_path(device_name)
        measured = json.loads(path.read_text()) if path.exists() else {}
        return cls(rates, measured)

    def save(self, device_name: str) -> Path:
        path = self.cache_path(device_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.measured, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return path

    def measure(self, shapes: list[tuple[int, int, int]], device: str = "cuda") -> None:
        """Time bf16 ``F.linear`` and the fused int8 kernel for each (M, K, N) on the current GPU
        (median of ``triton.testing.do_bench``, random data) and remember the results."""
        import triton.testing

        from qfuse.nn import QLinear

        if not torch.cuda.is_available():
            raise QFuseError("CostModel.measure needs a CUDA GPU; use the analytic model on CPU.")
        for M, K, N in shapes:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
            q = QLinear.from_float(
                w.float(),
                None,
                x_scale=x.abs().amax().float() / 127.5,
                x_zero_point=None,
                out_dtype=torch.bfloat16,
            )
            bf16 = triton.testing.do_bench(
                lambda x=x, w=w: torch.nn.functional.linear(x, w), return_mode="median"
            )
            int8 = triton.testing.do_bench(lambda x=x, q=q: q(x), return_mode="median")
            self.measured[_key("bf16", M, K, N)] = bf16 * 1e3
            self.measured[_key("int8", M, K, N)] = int8 * 1e3


def layer_shapes(prepared, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of every Linear chain of a prepared model for ``tokens`` rows of input."""
    state = get_state(prepared)
    if state is None:
        raise QFuseError("qfuse.route expects a model returned by qfuse.prepare.")
    shapes = {}
    for chain in state.chains:
        if chain.kind != "linear":
            continue
        N, K = attr_tensor(prepared, chain.weight).shape
        shapes[chain.name] = (tokens, K, N)
    return shapes


def route(
    prepared, tokens: int, cost_model: CostModel | None = None, margin: float = 1.0
) -> dict[str, str]:
    """Layers predicted faster in float: ``{name: reason}``, ready for ``convert(keep_float=...)``.

    ``tokens`` is the serving M (batch x sequence). A layer stays float when the int8 kernel is
    not predicted at least ``margin`` times faster.

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 4096),))
        >>> sorted(qfuse.route(prepared, tokens=16))
        ['2']
    """
    model = cost_model or CostModel()
    keep = {}
    for name, (M, K, N) in layer_shapes(prepared, tokens).items():
        t_int8, src8 = model.predict_us("int8", M, K, N)
        t_bf16, src16 = model.predict_us("bf16", M, K, N)
        if t_bf16 * margin <= t_int8:
            keep[name] = (
                f"bf16 predicted faster at M={M}: {t_bf16:.1f} us vs int8 "
                f"{t_int8:.1f} us ({src16}/{src8})"
            )
    return keep
