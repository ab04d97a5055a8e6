"""Speed-aware routing: per layer, fused int8, fused fp8 or float (bf16 cuBLAS), by a cost model.

The model predicts a layer's time from its GEMM shape (M tokens x K -> N). It prefers measured
timings of the current GPU (``CostModel.measure`` times the three implementations with
``triton.testing.do_bench`` and caches them on disk per GPU name and shape; ``route(...,
measure=True)`` fills the cache for the shapes it needs); without them it uses the analytic
roofline ``max(2MNK / rate, bytes / bandwidth) + launch``, floored by the host's eager
per-call cost, with rates and costs measured on an H200 and a tile-occupancy factor, so a tiny
GEMM — where the quantized kernel's halved bytes and doubled rate cannot pay for its padded
tiles and its longer launch — stays float. The timings are eager (CUDA graphs remove the host
floor; measure under them yourself if you serve that way).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qfuse.analysis.table import text_table
from qfuse.errors import QFuseError
from qfuse.fileio import atomic_write_text, cache_dir
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.state import get_state

IMPLS = ("int8", "fp8", "bf16")
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates and eager host costs of one GPU (the defaults: an H200's, measured).

    Rates: the sustained throughput of cuBLAS bf16, qfuse's Triton int8 and cuBLAS fp8 GEMMs.
    ``hbm_tbps``: what weight-streaming GEMMs reach, below the bandwidth of a plain copy.
    ``host_us``: the per-call floor of eager launches, below which a layer cannot run however
    small (the smallest eager times of each implementation); from ``separate_quant_from_m``
    tokens on, the tuned configs quantize the input in a separate pass before the GEMM, so a
    fused layer pays two launches.
    """

    name: str = "NVIDIA H200"
    bf16_tflops: float = 694.0
    int8_tops: float = 1096.0
    fp8_tflops: float = 1272.0
    hbm_tbps: float = 3.0
    launch_us: float = 2.0  # GPU-side start-up of any kernel
    host_us: dict = field(default_factory=lambda: {"bf16": 7.0, "int8": 30.0, "fp8": 30.0})
    separate_quant_from_m: int = 128  # from here a fused layer is two launches
    tile: dict = field(default_factory=lambda: {"bf16": 64, "int8": 64, "fp8": 64})


def _occupancy(M: int, N: int, tile: int) -> float:
    """Useful fraction of the tiles a GEMM launches (M and N padded up to whole tiles)."""
    pad = lambda d: math.ceil(d / tile) * tile  # noqa: E731
    return (M * N) / (pad(M) * pad(N))


def analytic_us(impl: str, M: int, K: int, N: int, rates: DeviceRates) -> float:
    """Eager time in microseconds of one layer: the GPU roofline (input read, weights read,
    output write) plus kernel start-up, or the host's per-call floor when that is longer."""
    flops = 2.0 * M * N * K
    if impl == "bf16":
        rate, nbytes, launches = rates.bf16_tflops * 1e12, 2 * (M * K + N * K + M * N), 1
    elif impl in DTYPES:
        # float (bf16) input read once in the prologue, 1-byte weights, bf16 output
        tera = rates.int8_tops if impl == "int8" else rates.fp8_tflops
        rate, nbytes = tera * 1e12, 2 * M * K + N * K + 2 * M * N
        launches = 2 if M >= rates.separate_quant_from_m else 1
    else:
        raise QFuseError(f"unknown implementation {impl!r}; choose one of {IMPLS}.")
    rate *= _occupancy(M, N, rates.tile[impl])
    gpu = max(flops / rate, nbytes / (rates.hbm_tbps * 1e12)) * 1e6 + rates.launch_us * launches
    return max(gpu, rates.host_us[impl] * launches)


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
        return Path(cache_dir()) / f"costs-{device_name.replace(' ', '_')}.json"

    @classmethod
    def load(cls, device_name: str, rates: DeviceRates | None = None) -> CostModel:
        path = cls.cache_path(device_name)
        measured = json.loads(path.read_text()) if path.exists() else {}
        return cls(rates, measured)

    def save(self, device_name: str) -> Path:
        path = self.cache_path(device_name)
        atomic_write_text(path, json.dumps(self.measured, indent=1, sort_keys=True))
        return path

    @classmethod
    def current(cls) -> CostModel:
        """The model for this process's GPU: its cached measurements (if any) over the analytic
        H200 rates; on a machine without CUDA, the analytic model alone."""
        if torch.cuda.is_available():
            return cls.load(torch.cuda.get_device_name())
        return cls()

    def measure(
        self, shapes: list[tuple[int, int, int]], impls: tuple[str, ...] = IMPLS, device="cuda"
    ) -> None:
        """Time ``impls`` (bf16 ``F.linear``, the fused int8 / fp8 kernels) for each (M, K, N) on
        the current GPU (median of ``triton.testing.do_bench``, random data) and remember them."""
        import triton.testing

        from qfuse.nn import QLinear

        if not torch.cuda.is_available():
            raise QFuseError("CostModel.measure needs a CUDA GPU; use the analytic model on CPU.")
        for M, K, N in shapes:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
            for impl in impls:
                if impl == "bf16":
                    fn = lambda x=x, w=w: torch.nn.functional.linear(x, w)  # noqa: E731
                else:
                    q = QLinear.from_float(
                        w.float(),
                        None,
                        x_scale=x.abs().amax().float() / (127.5 if impl == "int8" else 448.0),
                        x_zero_point=None,
                        dtype=DTYPES[impl],
                        out_dtype=torch.bfloat16,
                    )
                    fn = lambda x=x, q=q: q(x)  # noqa: E731
                    ref = torch.nn.functional.linear(x.float(), w.float())
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    if not err < 0.1:  # int8 ~0.01, fp8 ~0.03 on these random inputs
                        raise QFuseError(
                            f"CostModel.measure: the {impl} kernel is wrong at {M}x{K}x{N} "
                            f"(relative error {err:.3g}); not timing it."
                        )
                ms = triton.testing.do_bench(fn, return_mode="median")
                self.measured[_key(impl, M, K, N)] = ms * 1e3


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


@dataclass
class RoutePlan:
    """Per layer, the implementation predicted fastest and the predictions behind it.

    ``qfuse.convert(prepared, **plan.convert_kwargs())`` applies it; every routed layer's
    reason shows in ``qfuse.summary``."""

    tokens: int
    choices: dict[str, str]  # layer -> "int8" | "fp8" | "bf16"
    predictions: dict[str, dict[str, tuple[float, str]]]  # layer -> impl -> (us, source)

    def reason(self, name: str) -> str:
        times = ", ".join(
            f"{impl} {us:.1f} us ({src})" for impl, (us, src) in self.predictions[name].items()
        )
        return f"route: {self.choices[name]} predicted fastest at M={self.tokens}: {times}"

    @property
    def keep_float(self) -> dict[str, str]:
        return {n: self.reason(n) for n, impl in self.choices.items() if impl == "bf16"}

    @property
    def layer_dtypes(self) -> dict[str, torch.dtype]:
        return {n: DTYPES[impl] for n, impl in self.choices.items() if impl in DTYPES}

    def convert_kwargs(self) -> dict:
        notes = {n: self.reason(n) for n, impl in self.choices.items() if impl in DTYPES}
        return dict(keep_float=self.keep_float, layer_dtypes=self.layer_dtypes, notes=notes)

    def __str__(self) -> str:
        impls = list(dict.fromkeys(i for p in self.predictions.values() for i in p))
        rows = []
        for name, impl in self.choices.items():
            times = {
                i: f"{us:.1f}{'*' if src == 'measured' else ' '}"
                for i, (us, src) in self.predictions[name].items()
            }
            rows.append([name, impl, *(times.get(i, "") for i in impls)])
        header = ["layer", "route", *(f"{i} us" for i in impls)]
        table = text_table(header, rows, right=range(2, len(header)))
        note = "(* measured on this GPU; the rest analytic)"
        return f"route at M={self.tokens} tokens\n{table}\n{note}"


def _supported(impls: tuple[str, ...]) -> tuple[str, ...]:
    """fp8 needs sm_89+ (Ada/Hopper); on an older GPU it is no candidate."""
    if "fp8" in impls and torch.cuda.is_available():
        if torch.cuda.get_device_capability() < (8, 9):
            return tuple(i for i in impls if i != "fp8")
    return impls


def route(
    prepared,
    tokens: int,
    cost_model: CostModel | None = None,
    margin: float = 1.0,
    candidates: tuple[str, ...] = IMPLS,
    measure: bool = False,
) -> RoutePlan:
    """Per Linear layer, fused int8, fused fp8 or bf16 — whichever the cost model predicts
    fastest at ``tokens`` rows (the serving M, batch x sequence).

    The config's own dtype is kept unless another quantized dtype is predicted ``margin`` times
    faster; a layer stays bf16 unless a quantized kernel is predicted ``margin`` times faster.
    ``cost_model`` defaults to ``CostModel.current()`` (this GPU's cached measurements, else
    analytic); ``measure=True`` first times the shapes it lacks on this GPU and caches them.
    ``candidates`` limits the choice (e.g. ``("int8", "bf16")``); fp8 drops out on GPUs older
    than sm_89. Routing is about speed only: check accuracy (``auto_fallback``) on the result.

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (torch.randn(2, 4096),))
        >>> plan = qfuse.route(prepared, tokens=4096, cost_model=qfuse.CostModel())  # analytic
        >>> plan.choices
        {'0': 'fp8', '2': 'bf16'}
        >>> _ = prepared(torch.randn(8, 4096))
        >>> qmodel = qfuse.convert(prepared, **plan.convert_kwargs())
    """
    unknown = set(candidates) - set(IMPLS)
    if unknown or "bf16" not in candidates:
        raise QFuseError(
            f"route candidates {tuple(candidates)}: choose from {IMPLS}, always including "
            "'bf16' (the float fallback)."
        )
    candidates = _supported(tuple(candidates))
    shapes = layer_shapes(prepared, tokens)
    model = cost_model or CostModel.current()
    if measure:
        missing = sorted(
            {s for s in shapes.values() for i in candidates if _key(i, *s) not in model.measured}
        )
        if missing:
            model.measure(missing, candidates)
            model.save(torch.cuda.get_device_name())
    own = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}[get_state(prepared).config.dtype]
    choices, predictions = {}, {}
    for name, (M, K, N) in shapes.items():
        pred = {impl: model.predict_us(impl, M, K, N) for impl in candidates}
        choices[name] = choose({i: us for i, (us, _) in pred.items()}, own, margin)
        predictions[name] = pred
    return RoutePlan(tokens, choices, predictions)


def choose(times_us: dict[str, float], own: str, margin: float = 1.0) -> str:
    """The implementation to run, from predicted times (``"bf16"`` always among them): the
    config's ``own`` quantized dtype unless another is ``margin`` times faster, and bf16 unless
    the chosen quantized one is ``margin`` times faster than it."""
    quantized = [i for i in times_us if i != "bf16"]
    if not quantized:
        return "bf16"
    best = own if own in quantized else min(quantized, key=times_us.get)
    for impl in quantized:
        if times_us[impl] * margin < times_us[best]:
            best = impl
    return "bf16" if times_us["bf16"] * margin <= times_us[best] else best
