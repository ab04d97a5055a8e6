"""``qfuse.auto_fallback``: the fewest layers to take out of int8 to keep the metric drop within
budget — back to float, or (``fallback="fp8"``) to fp8, which keeps them fused and fast.

Deterministic search: rank layers by their own sensitivity (``qfuse.sensitivity``), find the
shortest prefix of that ranking whose fallback meets the budget (binary search, assuming more
fallback layers never hurt), then try to re-quantize each of them, least sensitive first, and
keep it quantized if the budget still holds. Every fallback layer's reason lands in
``qfuse.summary``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from qfuse.analysis.sensitivity import SensitivityReport, sensitivity
from qfuse.errors import QFuseError
from qfuse.flows.convert import convert
from qfuse.observers.base import observers_disabled
from qfuse.progress import progress_bar
from qfuse.state import get_state

FALLBACKS = ("float", "fp8")


@dataclass
class FallbackResult:
    baseline: float
    metric: float  # of the returned model
    max_drop: float
    fallback: str  # "float" | "fp8"
    fallback_layers: dict[str, str]  # layer -> why it left int8
    evaluations: int
    report: SensitivityReport
    trace: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    @property
    def kept_float(self) -> dict[str, str]:
        return self.fallback_layers if self.fallback == "float" else {}


@torch.no_grad()
def auto_fallback(
    prepared: fx.GraphModule,
    eval_fn: Callable[[torch.nn.Module], float],
    max_drop: float,
    *,
    higher_is_better: bool = True,
    data: Iterable | None = None,
    report: SensitivityReport | None = None,
    fallback: str = "float",
    quiet: bool = False,
) -> tuple[fx.GraphModule, FallbackResult]:
    """Convert ``prepared`` with the fewest layers moved out of the config's precision (to float,
    or to fp8 with ``fallback="fp8"``) such that the metric drop <= max_drop.

    Returns ``(qmodel, FallbackResult)``. Pass a ``report`` from ``qfuse.sensitivity`` to reuse it.
    A bar counts the evaluations (``quiet=True``, or stderr not a terminal, hides it).
    """
    if fallback not in FALLBACKS:
        raise QFuseError(f"fallback={fallback!r}: choose one of {FALLBACKS}.")
    if fallback == "fp8" and get_state(prepared).config.dtype == torch.float8_e4m3fn:
        raise QFuseError("fallback='fp8' moves int8 layers to fp8; this config is already fp8.")

    def convert_with(layers: dict[str, str]):
        if fallback == "float":
            return convert(prepared, keep_float=layers)
        return convert(
            prepared, layer_dtypes={n: torch.float8_e4m3fn for n in layers}, notes=layers
        )

    bar = progress_bar("auto_fallback evaluations", quiet)
    with observers_disabled(prepared):
        baseline = eval_fn(prepared)
    trace: list[tuple[tuple[str, ...], float]] = []

    def drop_of(metric: float) -> float:
        return (baseline - metric) if higher_is_better else (metric - baseline)

    def evaluate(kept: tuple[str, ...]) -> float:
        metric = eval_fn(convert_with({n: "candidate" for n in kept}))
        trace.append((kept, metric))
        bar.update()
        return metric

    # Cheap check first: the sensitivity pass below converts every layer once.
    if (
        fallback == "fp8"
        and drop_of(evaluate(tuple(c.name for c in get_state(prepared).chains))) > max_drop
    ):
        raise QFuseError(
            f"auto_fallback: even with every layer in fp8 the metric drops by more than "
            f"{max_drop}; use fallback='float', or a larger max_drop."
        )
    computed_report = report is None
    if computed_report:
        report = sensitivity(
            prepared, data=data, eval_fn=eval_fn, higher_is_better=higher_is_better, quiet=quiet
        )
    ranking = [r.name for r in report.ranked()]
    rank_of = {r.name: (i, r) for i, r in enumerate(report.ranked())}

    # Shortest prefix of the ranking that meets the budget. All layers in float always does (it is
    # the baseline); all in fp8 was checked above.
    lo, hi = 0, len(ranking)
    metrics = {}
    while lo < hi:
        mid = (lo + hi) // 2
        metrics[mid] = evaluate(tuple(ranking[:mid]))
        if drop_of(metrics[mid]) <= max_drop:
            hi = mid
        else:
            lo = mid + 1
    kept = list(ranking[:lo])
    # Prune: a kept layer may be unnecessary once a more sensitive one is float.
    for name in reversed(list(kept)):
        trial = tuple(k for k in kept if k != name)
        if drop_of(evaluate(trial)) <= max_drop:
            kept.remove(name)

    reasons = {}
    for name in kept:
        i, row = rank_of[name]
        alone = (
            f"alone it drops the metric by {row.drop:.4g}"
            if row.drop is not None
            else (f"alone it gives {row.sqnr_db:.1f} dB output SQNR")
        )
        reasons[name] = (
            f"auto_fallback to {fallback}: sensitivity rank {i + 1}/{len(ranking)}, {alone}; "
            f"needed for drop <= {max_drop}"
        )
    qmodel = convert_with(reasons)
    metric = eval_fn(qmodel)
    bar.close()
    # the searches, the final model, and the sensitivity pass if this call ran it
    evaluations = len(trace) + 1 + (len(report.rows) if computed_report else 0)
    result = FallbackResult(
        baseline, metric, max_drop, fallback, reasons, evaluations, report, trace
    )
    return qmodel, result
