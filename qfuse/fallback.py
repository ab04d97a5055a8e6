"""``qfuse.auto_fallback``: the fewest float layers that keep the metric drop within budget.

Deterministic search: rank layers by their own sensitivity (``qfuse.sensitivity``), find the
shortest prefix of that ranking whose float fallback meets the budget (binary search, assuming
more float layers never hurt), then try to re-quantize each kept layer, least sensitive first, and
keep it quantized if the budget still holds. Every kept layer's reason lands in ``qfuse.summary``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from qfuse.convert import convert
from qfuse.observers.base import observers_disabled
from qfuse.sensitivity import SensitivityReport, sensitivity


@dataclass
class FallbackResult:
    baseline: float
    metric: float  # of the returned model
    max_drop: float
    kept_float: dict[str, str]
    evaluations: int
    report: SensitivityReport
    trace: list[tuple[tuple[str, ...], float]] = field(default_factory=list)


@torch.no_grad()
def auto_fallback(
    prepared: fx.GraphModule,
    eval_fn: Callable[[torch.nn.Module], float],
    max_drop: float,
    *,
    higher_is_better: bool = True,
    data: Iterable | None = None,
    report: SensitivityReport | None = None,
) -> tuple[fx.GraphModule, FallbackResult]:
    """Convert ``prepared`` keeping the fewest layers float such that the metric drop <= max_drop.

    Returns ``(qmodel, FallbackResult)``. Pass a ``report`` from ``qfuse.sensitivity`` to reuse it.
    """
    with observers_disabled(prepared):
        baseline = eval_fn(prepared)
    trace: list[tuple[tuple[str, ...], float]] = []

    def drop_of(metric: float) -> float:
        return (baseline - metric) if higher_is_better else (metric - baseline)

    def evaluate(kept: tuple[str, ...]) -> float:
        qmodel = convert(prepared, keep_float={n: "candidate" for n in kept})
        metric = eval_fn(qmodel)
        trace.append((kept, metric))
        return metric

    if report is None:
        report = sensitivity(
            prepared, data=data, eval_fn=eval_fn, higher_is_better=higher_is_better
        )
    ranking = [r.name for r in report.ranked()]
    rank_of = {r.name: (i, r) for i, r in enumerate(report.ranked())}

    # Shortest prefix of the ranking that meets the budget (prefix of all layers always does).
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
            f"auto_fallback: sensitivity rank {i + 1}/{len(ranking)}, {alone}; "
            f"needed for drop <= {max_drop}"
        )
    qmodel = convert(prepared, keep_float=reasons)
    metric = eval_fn(qmodel)
    evaluations = len(trace) + 1 + len(report.rows)
    result = FallbackResult(baseline, metric, max_drop, reasons, evaluations, report, trace)
    return qmodel, result
