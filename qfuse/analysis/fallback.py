"""``qfuse.auto_fallback``: the fewest layers to take out of int8 to keep the metric drop within
budget — back to float, or (``fallback="fp8"``) to fp8, which keeps them fused and fast.

Deterministic search: rank layers by their own sensitivity (``qfuse.sensitivity``), find the
shortest prefix of that ranking whose fallback meets the budget (binary search, assuming more
fallback layers never hurt), then try to re-quantize each of them, least sensitive first, and
keep it quantized if the budget still holds. Every fallback layer's reason lands in
``qfuse.summary``.

A layer budget (``max_layers`` / ``max_fraction``) caps how many layers may leave int8, as a
deployment does ("at most 10% of the Linears outside int8"): the most sensitive layers up to
the cap, or with ``max_drop`` too the shortest prefix of them that meets it. A metric budget
alone can be out of reach where a layer budget is not: on SmolLM2-135M every Linear in fp8
static still loses 3.4% perplexity (fp8's own rounding), so static int8 with ``max_drop`` at
2.5% had no answer, though a few of its down projections in fp8 are what it needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from qfuse.analysis.sensitivity import SensitivityReport, sensitivity
from qfuse.errors import QFuseError
from qfuse.flows.convert import convert
from qfuse.fusion.siblings import merged_path
from qfuse.observers.base import observers_disabled
from qfuse.progress import progress_bar
from qfuse.state import get_state

FALLBACKS = ("float", "fp8", "per-token")


@dataclass
class FallbackResult:
    baseline: float
    metric: float  # of the returned model
    max_drop: float | None
    fallback: str  # "float" | "fp8" | "per-token"
    fallback_layers: dict[str, str]  # layer -> why it left int8
    evaluations: int
    report: SensitivityReport
    trace: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    max_layers: int | None = None  # the layer budget, when one was given
    met: bool = True  # False: max_drop was not reached within the layer budget
    layers: int = 0  # the model's quantized Linear/conv layers (a merged Q/K/V counts three)
    moved: int = 0  # of them, those that left int8

    @property
    def kept_float(self) -> dict[str, str]:
        return self.fallback_layers if self.fallback == "float" else {}


@torch.no_grad()
def auto_fallback(
    prepared: fx.GraphModule,
    eval_fn: Callable[[torch.nn.Module], float],
    max_drop: float | None = None,
    *,
    max_layers: int | None = None,
    max_fraction: float | None = None,
    higher_is_better: bool = True,
    data: Iterable | None = None,
    report: SensitivityReport | None = None,
    fallback: str = "float",
    quiet: bool = False,
) -> tuple[fx.GraphModule, FallbackResult]:
    """Convert ``prepared`` with the fewest layers moved out of the config's precision (to float,
    to fp8 with ``fallback="fp8"``, or, in a static config, to per-token activations of the same
    dtype with ``fallback="per-token"``: still int8 GEMMs, but a range per token where one per
    tensor cannot serve, as an LLM's sink tokens in ``down_proj``) such that the metric drop <=
    max_drop.

    A layer budget, ``max_layers`` (a count) or ``max_fraction`` (a share, rounded down) of
    the model's Linear/conv layers (a merged Q/K/V layer counts three), caps the layers moved:
    without ``max_drop`` the most sensitive layers that fit the cap move; with it, the shortest
    most-sensitive-first prefix of those that meets ``max_drop``, or all of them with
    ``result.met`` False when none does.

    Returns ``(qmodel, FallbackResult)``. Pass a ``report`` from ``qfuse.sensitivity`` to reuse it.
    A bar counts the evaluations (``quiet=True``, or stderr not a terminal, hides it).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
        ...                       nn.Linear(8, 2)).eval()
        >>> x = torch.randn(32, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
        >>> _ = prepared(x)
        >>> score = lambda m: -float((m(x) - model(x)).abs().max())
        >>> qmodel, fb = qfuse.auto_fallback(prepared, score, max_layers=1, data=[x],
        ...                                  fallback="fp8", quiet=True)
        >>> len(fb.fallback_layers), fb.max_layers
        (1, 1)
    """
    if fallback not in FALLBACKS:
        raise QFuseError(f"fallback={fallback!r}: choose one of {FALLBACKS}.")
    if fallback == "fp8" and get_state(prepared).config.dtype == torch.float8_e4m3fn:
        raise QFuseError("fallback='fp8' moves int8 layers to fp8; this config is already fp8.")
    if fallback == "per-token" and get_state(prepared).config.is_dynamic:
        raise QFuseError("fallback='per-token' moves static layers to per-token activations; "
                         "this config is already dynamic.")
    sizes = layer_sizes(prepared)
    cap = layer_budget(max_layers, max_fraction, sum(sizes.values()))
    if max_drop is None and cap is None:
        raise QFuseError(
            "auto_fallback needs a budget: max_drop (the metric drop allowed), max_layers or "
            "max_fraction (how many layers may leave int8), or both."
        )

    def convert_with(layers: dict[str, str]):
        if fallback == "float":
            return convert(prepared, keep_float=layers)
        if fallback == "per-token":
            return convert(prepared, per_token=list(layers), notes=layers)
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

    # Cheap check first: the sensitivity pass below converts every layer once. Under a layer
    # budget falling short of max_drop is an answer (``met``), not an error.
    if (
        cap is None
        and fallback == "fp8"
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
    n_ranked = len(ranking)

    if cap is not None:  # the most sensitive layers that fit the cap, in ranking order
        ranking = within(ranking, sizes, cap)
    met = True
    if max_drop is None:  # a layer budget alone: its most sensitive layers, no search
        kept = list(ranking)
    else:
        # Shortest prefix of the ranking that meets the budget. All layers in float always
        # does (it is the baseline); all in fp8 was checked above; under a layer cap the
        # longest prefix allowed may not.
        top = len(ranking)
        lo, hi = 0, top
        if cap is not None:
            met = drop_of(evaluate(tuple(ranking[:top]))) <= max_drop
        while met and lo < hi:
            mid = (lo + hi) // 2
            if drop_of(evaluate(tuple(ranking[:mid]))) <= max_drop:
                hi = mid
            else:
                lo = mid + 1
        kept = list(ranking[: lo if met else top])
        # Prune: a kept layer may be unnecessary once a more sensitive one is float.
        for name in reversed(list(kept) if met else []):
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
        why = f"needed for drop <= {max_drop}" if max_drop is not None and met else ""
        if cap is not None:
            why += ("; " if why else "") + f"within the budget of {cap} Linear/conv layers"
        reasons[name] = (
            f"auto_fallback to {fallback}: sensitivity rank {i + 1}/{n_ranked}, {alone}; " + why
        )
    qmodel = convert_with(reasons)
    metric = eval_fn(qmodel)
    bar.close()
    # the searches, the final model, and the sensitivity pass if this call ran it
    evaluations = len(trace) + 1 + (len(report.rows) if computed_report else 0)
    result = FallbackResult(
        baseline,
        metric,
        max_drop,
        fallback,
        reasons,
        evaluations,
        report,
        trace,
        cap,
        met,
        sum(sizes.values()),
        sum(sizes[n] for n in reasons),
    )
    return qmodel, result


def layer_sizes(prepared: fx.GraphModule) -> dict[str, int]:
    """Each quantized layer's count of the model's own layers: a merged Q/K/V layer is three
    Linears, so a budget of "10% of the Linears" counts it three times."""
    state = get_state(prepared)
    members = {merged_path(group): len(group) for group in state.merged}
    return {c.name: members.get(c.name, 1) for c in state.chains}


def within(ranking: list[str], sizes: dict[str, int], cap: int) -> list[str]:
    """The layers of ``ranking``, in order, that fit ``cap`` counted in ``sizes`` (one that
    does not fit is skipped; a smaller one after it may still fit).

    Example:
        >>> within(["qkv", "down", "o"], {"qkv": 3, "down": 1, "o": 1}, 2)
        ['down', 'o']
    """
    out, used = [], 0
    for name in ranking:
        if used + sizes.get(name, 1) <= cap:
            out.append(name)
            used += sizes.get(name, 1)
    return out


def layer_budget(max_layers: int | None, max_fraction: float | None, n_layers: int) -> int | None:
    """The number of layers a fallback may move: ``max_layers``, ``max_fraction`` of
    ``n_layers`` rounded down, the smaller of both, or None (no cap).

    Example:
        >>> layer_budget(None, 0.1, 210), layer_budget(5, 0.1, 210), layer_budget(None, None, 9)
        (21, 5, None)
    """
    caps = []
    if max_layers is not None:
        if isinstance(max_layers, bool) or not isinstance(max_layers, int) or max_layers < 0:
            raise QFuseError(
                f"auto_fallback max_layers={max_layers!r}: pass a layer count >= 0 "
                f"(this model has {n_layers} quantized layers), or max_fraction=0.1 for a share."
            )
        caps.append(max_layers)
    if max_fraction is not None:
        if not isinstance(max_fraction, (int, float)) or not 0.0 <= max_fraction <= 1.0:
            raise QFuseError(
                f"auto_fallback max_fraction={max_fraction!r}: pass a share of the "
                f"{n_layers} quantized layers in [0, 1], e.g. 0.1 for at most 10%."
            )
        caps.append(int(max_fraction * n_layers + 1e-9))
    return min(caps) if caps else None
