"""The noise margin of a metric drop: ``PerWindow`` scores and their paired confidence bound.

A budget met on a few validation windows need not hold on unseen text: on SmolLM2-135M, 8
validation windows gave the search's winner +0.94% perplexity against a 1% budget, and the 12
held-out windows +1.27%. When ``eval_fn`` returns ``PerWindow`` (the same windows, in the same
order, for every model), ``qfuse.search`` bounds each candidate's drop from above: the mean of
the paired per-window differences vs float, moved by a one-sided Student-t quantile times its
standard error, through the metric's ``link``. ``drop + margin`` is that bound; a candidate meets
the budget only when it is <= max_drop. A plain float from ``eval_fn`` has no spread to bound:
its margin is 0 (the drop alone is compared, as before).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from qfuse.errors import QFuseError

CONFIDENCE = 0.95  # one-sided: a candidate's true drop exceeds drop + margin 1 time in 20


@dataclass(frozen=True)
class PerWindow:
    """A metric measured window by window: ``metric == link(mean(values))``, ``link``
    increasing (None: the mean itself). Perplexity: per-window mean NLL, ``link=math.exp``;
    accuracy: per-batch accuracy of equal batches, no link.

    Example:
        >>> import math
        >>> s = PerWindow((2.0, 3.0), link=math.exp)
        >>> round(s.metric, 4), float(s) == s.metric, len(s)
        (12.1825, True, 2)
    """

    values: tuple[float, ...]
    link: Callable[[float], float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not self.values:
            raise QFuseError("PerWindow needs at least one window's value.")

    def __len__(self) -> int:
        return len(self.values)

    def __float__(self) -> float:
        return self.metric

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    @property
    def metric(self) -> float:
        return self.at(self.mean)

    def at(self, mean: float) -> float:
        """The metric of a per-window mean."""
        return float(self.link(mean)) if self.link is not None else mean


def t_quantile(p: float, df: int) -> float:
    """Student t's ``p`` quantile with ``df`` degrees of freedom: exact for 1 and 2, else the
    Cornish-Fisher expansion around the normal quantile (within 0.001 of the table at p=0.95
    from df=3: 2.3523 vs 2.3534; 1.7531 vs 1.7531 at df=15).

    Example:
        >>> round(t_quantile(0.95, 15), 3), round(t_quantile(0.95, 1), 3)
        (1.753, 6.314)
    """
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


@dataclass(frozen=True)
class Bound:
    """A candidate's ``metric``, its ``drop`` vs the baseline and the ``margin`` that
    ``drop + margin`` (the one-sided upper confidence bound of the drop) adds."""

    metric: float
    drop: float
    margin: float = 0.0

    @property
    def worst(self) -> float:
        return self.drop + self.margin


def bound(scores, baseline, higher_is_better: bool = True, confidence: float = CONFIDENCE) -> Bound:
    """``scores`` (a model's ``eval_fn`` result) against ``baseline`` (float's): its drop and,
    when both are ``PerWindow``, the margin of the paired per-window differences.

    Example:
        >>> base = PerWindow((1.0, 2.0, 3.0, 4.0))
        >>> steady = bound(PerWindow((0.9, 1.9, 2.9, 3.9)), base)  # every window 0.1 lower
        >>> round(steady.drop, 6), round(steady.margin, 6)
        (0.1, 0.0)
        >>> noisy = bound(PerWindow((1.3, 1.5, 3.3, 3.5)), base)  # the same mean drop
        >>> round(noisy.drop, 6), noisy.margin > 0.3
        (0.1, True)
        >>> bound(0.9, 1.0)
        Bound(metric=0.9, drop=0.09999999999999998, margin=0.0)
    """
    sign = 1.0 if higher_is_better else -1.0
    metric, base = float(scores), float(baseline)
    drop = sign * (base - metric)
    if not (isinstance(scores, PerWindow) and isinstance(baseline, PerWindow)):
        return Bound(metric, drop)
    if len(scores) != len(baseline):
        raise QFuseError(
            f"eval_fn gave {len(scores)} per-window values for this model and {len(baseline)} "
            "for float: a PerWindow metric needs the same windows, in the same order, each call."
        )
    n = len(scores)
    if n < 2:
        return Bound(metric, drop)
    diffs = [a - b for a, b in zip(scores.values, baseline.values, strict=True)]
    mean = math.fsum(diffs) / n
    var = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    step = t_quantile(confidence, n - 1) * math.sqrt(var / n)
    worst = sign * (base - scores.at(scores.mean - sign * step))
    return Bound(metric, drop, max(0.0, worst - drop))


def rule(scores, confidence: float = CONFIDENCE) -> str:
    """The margin's rule in words, for a metric like ``scores`` (the float baseline's).

    Example:
        >>> rule(PerWindow((1.0,) * 16))[-52:]
        '16 windows (Student t, 15 df: 1.753 standard errors)'
        >>> rule(1.0)[:40]
        'no margin: eval_fn returns one number pe'
    """
    if not isinstance(scores, PerWindow):
        return (
            "no margin: eval_fn returns one number per model, not PerWindow values, so the "
            "drop alone is compared to max_drop"
        )
    n = len(scores)
    if n < 2:
        return "no margin: eval_fn's PerWindow has one window, which gives no spread"
    return (
        f"margin: one-sided {confidence:.0%} upper confidence bound of the drop, from the "
        f"paired per-window differences vs float over {n} windows (Student t, {n - 1} df: "
        f"{t_quantile(confidence, n - 1):.3f} standard errors)"
    )
