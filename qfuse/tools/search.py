"""``qfuse.search``: the fastest calibration setup whose metric drop meets a budget, measured.

The space is dtype (int8/fp8) x activations (static per-tensor / dynamic per-token) x observer
x symmetric x SmoothQuant alpha (its default layers, or every Linear) x GPTQ x auto_fallback.
Observer, SmoothQuant and GPTQ change accuracy but not the kernels that run, so speed is decided
by the dtype, the activation scheme and the layers kept float. The search therefore:

1. measures the plain candidate of each scheme (dtype x activations; MinMax, symmetric): metric
   and latency (the probes re-timed interleaved, round by round), and visits schemes fastest
   first;
2. per scheme, climbs accuracy only while the budget is unmet: observer x symmetric (static
   activations only: a dynamic scale reads no observer), then SmoothQuant alphas (stopping when
   a larger alpha stops helping), then GPTQ (on the smoothed candidate, and without the
   smoothing too) — a step is kept only if it measured better;
3. if still short, ``qfuse.auto_fallback`` moves the fewest layers out (to float, or to fp8 with
   ``SearchSpace(fallback="fp8")``; slower, so measured), ranked by ``qfuse.sensitivity`` in the
   space's ``sensitivity`` mode, within its layer budget ``fallback_fraction``;
4. prunes a scheme whose plain latency is already slower than a config that meets the budget
   (the two re-timed interleaved first: they were timed minutes apart).

When ``eval_fn`` returns ``qfuse.tools.margin.PerWindow`` scores, "meets the budget" means the
drop plus a noise margin (the one-sided 95% upper confidence bound of the paired per-window
differences vs float, ``confidence``) is <= max_drop — at every step above, auto_fallback's own
stopping rule included; a plain float keeps the drop alone (margin 0, said in ``why``).

Every evaluation is a step of ``SearchResult.path``; the winner is the fastest that met the budget,
re-timed against the other winners in interleaved rounds; within ``timing.NOISE_MARGIN`` of the
fastest, the better metric wins (the same inputs give the same choice, timing noise aside).
``SearchResult.why`` says so in words: the winner, the others that met the budget and their
latencies, and the candidates over it. ``SearchSpace.llm()`` is the space for decoder LLMs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from qfuse.algorithms.gptq import GPTQ
from qfuse.algorithms.smoothquant import SmoothQuant
from qfuse.analysis.fallback import FallbackResult, auto_fallback
from qfuse.analysis.sensitivity import call, sensitivity
from qfuse.config import PerTensor, PerToken, QConfig
from qfuse.errors import QFuseError
from qfuse.flows.convert import convert
from qfuse.tools.calibrate import Calibrations, key_of, progress
from qfuse.tools.margin import CONFIDENCE, PerWindow, bound, rule
from qfuse.tools.timing import error_text, fastest, median_ms, repeated_ms

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
ACTIVATIONS = {"static": PerTensor, "dynamic": PerToken}
SENSITIVITY = ("full", "local")
FP8_NOTE = "qfuse.search: auto_fallback to fp8"


class SearchError(QFuseError):
    """No candidate met the budget; ``path`` holds every step the search took."""

    def __init__(self, message: str, path: list) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class SearchSpace:
    """What ``search`` may try. ``symmetric=(True, False)`` applies to static int8 (fp8 and
    dynamic activations are symmetric). ``activations``: "static" (per-tensor scales from
    calibration) and/or "dynamic" (per-token scales at run time). ``smoothquant_layers``: None
    smooths SmoothQuant's default layers (fed by a norm or a Linear), ``("*",)`` every Linear;
    it applies to static schemes (a dynamic layer has no static input scale to carry the factors
    in its prologue, so dynamic schemes smooth the default layers, where the factors fold).
    ``fallback``: where auto_fallback moves layers, "float" or "fp8" (int8 schemes; an fp8
    scheme falls back to float); ``fallback_fraction``: its layer budget, the share of the
    Linears it may move (None: no cap). ``sensitivity``: how auto_fallback ranks the layers,
    "full" (the metric with each layer quantized alone: a convert and an evaluation per layer)
    or "local" (each layer's own output SQNR on one calibration batch, ``qfuse.sensitivity(...,
    method="local")``: no convert per layer, what an LLM can afford).

    Example:
        >>> SearchSpace().activations, SearchSpace.llm().activations
        (('static',), ('dynamic',))
    """

    dtypes: tuple[str, ...] = ("int8", "fp8")
    observers: tuple[str, ...] = ("minmax", "histogram_mse", "percentile")
    symmetric: tuple[bool, ...] = (True, False)
    smoothquant_alphas: tuple[float, ...] = (0.5, 0.75)
    gptq: bool = True
    auto_fallback: bool = True
    activations: tuple[str, ...] = ("static",)
    smoothquant_layers: tuple[str, ...] | None = None
    fallback: str = "float"
    fallback_fraction: float | None = None
    sensitivity: str = "full"

    def __post_init__(self) -> None:
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown or not self.dtypes:
            raise QFuseError(f"SearchSpace dtypes {self.dtypes}: choose from {tuple(DTYPES)}.")
        bad = [a for a in self.activations if a not in ACTIVATIONS]
        if bad or not self.activations:
            raise QFuseError(
                f"SearchSpace activations {self.activations}: choose from {tuple(ACTIVATIONS)}."
            )
        if isinstance(self.smoothquant_layers, str):
            raise QFuseError("SearchSpace smoothquant_layers takes a tuple of globs, e.g. ('*',).")
        if self.fallback not in ("float", "fp8"):
            raise QFuseError(f"SearchSpace fallback={self.fallback!r}: 'float' or 'fp8'.")
        if self.sensitivity not in SENSITIVITY:
            raise QFuseError(
                f"SearchSpace sensitivity={self.sensitivity!r}: choose from {SENSITIVITY}."
            )

    @classmethod
    def llm(cls) -> SearchSpace:
        """Decoder LLMs: int8 and fp8 with dynamic per-token activations (a static per-tensor
        scale cannot serve their outlier channels: on SmolLM2 static int8 with SmoothQuant on
        every Linear and GPTQ still lost 2.4% perplexity, dynamic int8 with SmoothQuant 0.8 and
        GPTQ 0.9%); SmoothQuant at 0.6, 0.7, then 0.8 (llm-compressor's strength) while each
        helps (SmolLM2 on the H200 with GPTQ: 0.7 +0.59%, 0.8 +1.51%), on every Linear for a
        static scheme, where the factors fold for a dynamic one; GPTQ, with and without the
        smoothing; then auto_fallback of at most 10% of the Linears to fp8, ranked by the local
        sensitivity (no convert per layer).
        Static schemes too: ``dataclasses.replace(SearchSpace.llm(), activations=("dynamic",
        "static"))`` (on SmolLM2's CPU sweep each costs calibrations with GPTQ and misses 1%)."""
        return cls(
            dtypes=("int8", "fp8"),
            observers=("minmax",),
            symmetric=(True,),
            smoothquant_alphas=(0.6, 0.7, 0.8),
            gptq=True,
            auto_fallback=True,
            activations=("dynamic",),
            smoothquant_layers=("*",),
            fallback="fp8",
            fallback_fraction=0.1,
            sensitivity="local",
        )

    def schemes(self) -> list[tuple[str, str]]:
        """(dtype, activations) pairs, in the space's order."""
        return [(d, a) for a in self.activations for d in self.dtypes]


def scheme_name(dtype: str, activations: str) -> str:
    """"int8" / "fp8" for static activations (the names the search always used), else
    "int8 dynamic" / "fp8 dynamic"."""
    return dtype if activations == "static" else f"{dtype} {activations}"


def plain_config(dtype: str, activations: str) -> QConfig:
    """The scheme's plain config: ``QConfig.int8_static()`` ... ``QConfig.fp8_dynamic()``."""
    return QConfig(dtype=DTYPES[dtype], activation_granularity=ACTIVATIONS[activations]())


@dataclass(frozen=True)
class Candidate:
    """One point of the space; ``prepare_kwargs()`` / ``convert_kwargs()`` reproduce it.

    Example:
        >>> import torch, qfuse
        >>> c = Candidate(qfuse.QConfig(symmetric=False), smoothquant=0.5, gptq=True)
        >>> c.label()
        'int8 static, minmax asym + SmoothQuant 0.5 + GPTQ'
        >>> sorted(c.prepare_kwargs())
        ['gptq', 'smoothquant']
        >>> d = Candidate(qfuse.QConfig.int8_static(), 0.8, True, smoothquant_layers=("*",),
        ...               fp8_layers=("down",))
        >>> d.label()
        'int8 static, minmax sym + SmoothQuant 0.8 on every Linear + GPTQ + auto_fallback (1 fp8)'
        >>> Candidate(qfuse.QConfig.fp8_dynamic(), gptq=True).label()
        'fp8 dynamic (per-token) + GPTQ'
        >>> d.prepare_kwargs()["smoothquant"].layers, sorted(d.convert_kwargs())
        (('*',), ['layer_dtypes', 'notes'])
    """

    config: QConfig
    smoothquant: float | None = None
    gptq: bool = False
    keep_float: tuple[str, ...] = ()
    smoothquant_layers: tuple[str, ...] | None = None  # None: SmoothQuant's default layers
    fp8_layers: tuple[str, ...] = ()  # auto_fallback to fp8 (int8 configs)

    def label(self) -> str:
        dtype = "int8" if self.config.dtype == torch.int8 else "fp8"
        if self.config.is_dynamic:
            text = f"{dtype} dynamic (per-token)"
        else:
            sym = ""
            if self.config.dtype == torch.int8:
                sym = " sym" if self.config.symmetric else " asym"
            text = f"{dtype} static, {self.config.observer}{sym}"
        if self.smoothquant is not None:
            text += f" + SmoothQuant {self.smoothquant:g}"
            if self.smoothquant_layers == ("*",):
                text += " on every Linear"
            elif self.smoothquant_layers is not None:
                text += f" on {','.join(self.smoothquant_layers)}"
        if self.gptq:
            text += " + GPTQ"
        if self.keep_float:
            text += f" + auto_fallback ({len(self.keep_float)} float)"
        if self.fp8_layers:
            text += f" + auto_fallback ({len(self.fp8_layers)} fp8)"
        return text

    def prepare_kwargs(self) -> dict:
        """Keyword arguments for ``qfuse.prepare`` besides the config."""
        out: dict = {}
        if self.smoothquant is not None:
            out["smoothquant"] = SmoothQuant(self.smoothquant, layers=self.smoothquant_layers)
        if self.gptq:
            out["gptq"] = GPTQ()
        return out

    def convert_kwargs(self) -> dict:
        """Keyword arguments for ``qfuse.convert``."""
        out: dict = {}
        if self.keep_float:
            out["keep_float"] = {n: "qfuse.search: auto_fallback" for n in self.keep_float}
        if self.fp8_layers:
            out["layer_dtypes"] = {n: torch.float8_e4m3fn for n in self.fp8_layers}
            out["notes"] = {n: FP8_NOTE for n in self.fp8_layers}
        return out

    def to_dict(self) -> dict:
        out = {
            "label": self.label(),
            "config": self.config.to_dict(),
            "smoothquant_alpha": self.smoothquant,
            "gptq": self.gptq,
            "keep_float": list(self.keep_float),
        }
        if self.smoothquant_layers is not None:
            out["smoothquant_layers"] = list(self.smoothquant_layers)
        if self.fp8_layers:
            out["fp8_layers"] = list(self.fp8_layers)
        return out


@dataclass
class Step:
    stage: str
    candidate: str
    metric: float | None
    drop: float | None
    latency_ms: float | None
    meets: bool
    note: str = ""
    margin: float | None = None  # drop + margin is the drop's upper confidence bound


@dataclass
class SearchResult:
    """The winner (``candidate``, its converted ``qmodel``) and the ``path`` the search took.

    ``config``, ``prepare_kwargs()`` and ``convert_kwargs()`` redo it on your model::

        prepared = qfuse.prepare(model, r.config, example, **r.prepare_kwargs())
        ...calibrate...
        qmodel = qfuse.convert(prepared, **r.convert_kwargs())
    """

    candidate: Candidate
    qmodel: torch.nn.Module
    baseline: float
    metric: float
    drop: float
    latency_ms: float
    max_drop: float
    path: list[Step] = field(default_factory=list)
    fallback: FallbackResult | None = None  # its metrics: at the margin's bound (drop + margin)
    why: str = ""  # the choice in words: fastest within the budget, and what was over it
    margin: float = 0.0  # the winner's: drop + margin <= max_drop
    margin_rule: str = ""  # how the margin was taken (or why there was none)

    @property
    def config(self) -> QConfig:
        return self.candidate.config

    def prepare_kwargs(self) -> dict:
        return self.candidate.prepare_kwargs()

    def convert_kwargs(self) -> dict:
        return self.candidate.convert_kwargs()

    def to_dict(self) -> dict:
        return {
            "candidate": self.candidate.to_dict(),
            "baseline": self.baseline,
            "metric": self.metric,
            "drop": self.drop,
            "latency_ms": self.latency_ms,
            "max_drop": self.max_drop,
            "margin": self.margin,
            "margin_rule": self.margin_rule,
            "evaluations": len(self.path),
            "why": self.why,
            "path": [asdict(s) for s in self.path],
        }


class _Search:
    def __init__(self, cache, eval_fn, max_drop, higher_is_better, time_fn, quiet, confidence):
        self.cache, self.eval_fn, self.max_drop = cache, eval_fn, max_drop
        self.higher_is_better = higher_is_better
        self.sign = 1.0 if higher_is_better else -1.0
        self.time_fn, self.quiet, self.confidence = time_fn, quiet, confidence
        self.path: list[Step] = []
        self.metrics: dict[Candidate, float] = {}
        self.margins: dict[Candidate, float] = {}
        self.latency: dict[Candidate, float] = {}
        self.models: dict[Candidate, torch.nn.Module] = {}
        self.baseline = 0.0
        self.scores: float | PerWindow = 0.0  # float's eval_fn result, per window when given
        self.failed: dict[Candidate, str] = {}

    def drop(self, metric: float) -> float:
        return self.sign * (self.baseline - metric)

    def worst(self, c: Candidate) -> float:
        """The candidate's drop plus its noise margin: what must be <= max_drop."""
        return self.drop(self.metrics[c]) + self.margins.get(c, 0.0)

    def meets(self, c: Candidate) -> bool:
        return c in self.metrics and self.worst(c) <= self.max_drop

    def record(self, c: Candidate, scores) -> None:
        b = bound(scores, self.scores, self.higher_is_better, self.confidence)
        self.metrics[c], self.margins[c] = b.metric, b.margin

    def drop_text(self, c: Candidate) -> str:
        """"drop 0.1862 + margin 0.0451" (the margin only when there is one)."""
        text = f"drop {self.drop(self.metrics[c]):.4g}"
        return text + (f" + margin {self.margins[c]:.4g}" if self.margins.get(c) else "")

    def prepared(self, c: Candidate):
        return self.cache.get(c.config, c.smoothquant, c.gptq, c.smoothquant_layers)

    def evaluate(
        self, stage: str, c: Candidate, timed: bool = False, note: str = ""
    ) -> float | None:
        """The candidate's metric (and latency when ``timed``), or None when it failed: a
        candidate that raises is a step with its error, not the end of the search."""
        if c in self.failed:
            return None
        try:
            if c not in self.metrics:
                qmodel = convert(self.prepared(c), **c.convert_kwargs())
                self.record(c, self.eval_fn(qmodel))
                self.models[c] = qmodel
            if timed and c not in self.latency:
                self.latency[c] = self.time_fn(self.models[c])
        except Exception as exc:  # noqa: BLE001 — recorded in the path, search goes on
            self.failed[c] = error_text(exc)
            self.metrics.pop(c, None)
            self.models.pop(c, None)
            self.path.append(Step(stage, c.label(), None, None, None, False, self.failed[c]))
            if not self.quiet:
                print(f"search [{stage}] {c.label()}: {self.failed[c]}", file=sys.stderr)
            return None
        m = self.metrics[c]
        step = Step(stage, c.label(), m, self.drop(m), self.latency.get(c), self.meets(c), note,
                    self.margins.get(c))
        self.path.append(step)
        if not self.quiet:
            ms = "" if step.latency_ms is None else f", {step.latency_ms:.3g} ms"
            print(
                f"search [{stage}] {step.candidate}: {m:.6g} ({self.drop_text(c)}{ms})",
                file=sys.stderr,
                flush=True,
            )
        return m

    def better(self, a: Candidate, b: Candidate) -> bool:
        """``a`` measured a smaller drop + margin than ``b`` (the quantity the budget bounds)."""
        if a not in self.metrics:
            return False
        return b not in self.metrics or self.worst(a) < self.worst(b)

    def note(self, stage: str, text: str) -> None:
        self.path.append(Step(stage, "", None, None, None, False, text))


def _climb(s: _Search, start: Candidate, space: SearchSpace, dtype: str,
           activations: str = "static") -> Candidate:
    """Accuracy steps on one scheme while the budget is unmet; returns the best measured."""
    best = start
    # a dynamic (per-token) scale is computed at run time: no observer or zero point to choose
    schemes = [] if activations != "static" else [
        (obs, sym)
        for obs in space.observers
        for sym in (space.symmetric if dtype == "int8" else (True,))
    ]
    for obs, sym in progress(schemes, f"search {dtype} schemes", s.quiet):
        if s.meets(best):
            return best
        c = Candidate(QConfig(dtype=DTYPES[dtype], symmetric=sym, observer=obs))
        if c == start:
            continue
        s.evaluate("observer x symmetric", c)
        if s.better(c, best):
            best = c
    # A dynamic layer has no static input scale to carry SmoothQuant's factors in its prologue:
    # it smooths only where they fold (into a norm or a producer Linear), the default layers.
    layers = space.smoothquant_layers if activations == "static" else None
    for alpha in space.smoothquant_alphas:
        if s.meets(best):
            return best
        c = replace(best, smoothquant=alpha, smoothquant_layers=layers)
        s.evaluate("SmoothQuant", c)
        if not s.better(c, best):
            s.note("SmoothQuant", f"alpha {alpha:g} did not improve: stop raising alpha")
            break
        best = c
    if space.gptq and not s.meets(best):
        tries = [replace(best, gptq=True)]
        if best.smoothquant is not None:
            # GPTQ rounds against the Hessian of the inputs it is given, and what it recovers
            # can make the smoothing unnecessary: measure it without SmoothQuant too (SmolLM2's
            # fp8 dynamic: +GPTQ alone beat +SmoothQuant +GPTQ).
            tries.append(replace(best, smoothquant=None, smoothquant_layers=None, gptq=True))
        for c in tries:
            if s.meets(best):
                break
            s.evaluate("GPTQ", c)
            if s.better(c, best):
                best = c
    return best


def _retime(s: _Search, candidates: list[Candidate]) -> None:
    """Time measured ``candidates`` again, interleaved round by round (``repeated_ms``), so that
    a slow spell of a shared machine slows them alike: the speed probes, and a scheme against
    the winner that would prune it, were each timed once and minutes apart. Their path steps
    take the new times."""
    cands = [c for c in dict.fromkeys(candidates) if c in s.models and c in s.latency]
    if len(cands) < 2:
        return
    try:
        times = repeated_ms({c.label(): (lambda c=c: s.time_fn(s.models[c])) for c in cands})
    except Exception as exc:  # noqa: BLE001 — the single timings stand
        s.note("timing", f"interleaved re-timing failed, single timings kept: {error_text(exc)}")
        return
    by_label = {c.label(): c for c in cands}
    for label, ms in times.items():
        s.latency[by_label[label]] = ms
    for step in s.path:
        if step.candidate in times and step.latency_ms is not None:
            step.latency_ms = times[step.candidate]


def _pick(s: _Search, winners: list[Candidate]) -> Candidate:
    """The fastest winner by timings repeated and interleaved (``repeated_ms``); winners within
    the noise margin of it tie, and the better metric (then the label) breaks the tie."""
    by_label = {c.label(): c for c in winners}
    if len(by_label) > 1:
        times = repeated_ms({k: (lambda c=c: s.time_fn(s.models[c])) for k, c in by_label.items()})
        for label, ms in times.items():
            s.latency[by_label[label]] = ms
    else:
        times = {k: s.latency[c] for k, c in by_label.items()}
    rank = {k: (s.worst(c),) for k, c in by_label.items()}
    return by_label[fastest(times, rank)]


def _fallback(s: _Search, best: Candidate, space: SearchSpace, higher_is_better: bool,
              results: dict) -> Candidate | None:
    """``auto_fallback`` from ``best``'s calibration: the space's target (fp8 only from int8),
    layer budget and ranking; the candidate it gives (measured and timed), or None.

    auto_fallback stops at the fewest layers whose drop meets max_drop; it is handed the
    metric at the search's confidence bound (``worst``), so that its stopping rule is the
    search's own: drop + margin <= max_drop (stopping "just under" the budget on the mean
    drop was what overfit 8 validation windows). Its sensitivity ranking uses the plain metric;
    the ``FallbackResult``'s own metrics (baseline, metric, trace) are those bounds.
    """
    prepared = s.prepared(best)
    to = space.fallback if best.config.dtype == torch.int8 else "float"
    seen: dict[int, object] = {}  # id(model) -> eval_fn's result, to keep the returned one's

    def worst(model) -> float:
        scores = seen[id(model)] = s.eval_fn(model)
        b = bound(scores, s.scores, higher_is_better, s.confidence)
        return b.metric - s.sign * b.margin

    try:
        if space.sensitivity == "local":
            report = sensitivity(prepared, data=s.cache.batches[:1], method="local",
                                 quiet=s.quiet)
        else:
            report = sensitivity(prepared, eval_fn=lambda m: float(s.eval_fn(m)),
                                 higher_is_better=higher_is_better, quiet=s.quiet)
        qmodel, fb = auto_fallback(
            prepared, worst, s.max_drop, higher_is_better=higher_is_better,
            max_fraction=space.fallback_fraction, fallback=to, report=report, quiet=s.quiet,
        )
    except Exception as exc:  # noqa: BLE001 — a failed fallback leaves the other schemes
        s.note("auto_fallback", f"{best.label()}: {error_text(exc)}")
        return None
    moved = tuple(sorted(fb.fallback_layers))
    c = replace(best, fp8_layers=moved) if to == "fp8" else replace(best, keep_float=moved)
    s.record(c, seen[id(qmodel)])
    s.models[c] = qmodel
    results[c] = fb
    how = f"{space.sensitivity} sensitivity ranking"
    if fb.max_layers is not None:
        how += f", at most {fb.max_layers} of {fb.layers} Linears"
    inside = fb.evaluations + (len(report.rows) if space.sensitivity == "full" else 0)
    note = f"{inside} evaluations inside; {how}; moved {fb.moved} to {to}"
    if not fb.met:
        note += "; the layer budget could not reach max_drop"
    s.evaluate("auto_fallback", c, timed=True, note=note)
    return c


def _why(s: _Search, win: Candidate, winners: list[Candidate]) -> str:
    """The choice in words: the fastest within the budget, its rivals, and what missed."""
    ms = lambda c: f"{s.latency[c]:.4g} ms" if c in s.latency else "not timed"  # noqa: E731
    text = (f"picked {win.label()}: the fastest configuration within the budget "
            f"({s.drop_text(win)} = {s.worst(win):.4g} <= {s.max_drop:.4g}), {ms(win)} per "
            f"forward by the search's time_fn")
    if len(winners) > 1:
        text += f" (the fastest of the {len(winners)} schemes' finalists, re-timed interleaved)"
    text += f"; {rule(s.scores, s.confidence)}"
    rivals = [c for c in s.metrics if c != win and s.meets(c)]
    if rivals:
        text += "; also within it, slower or searched past: " + ", ".join(
            f"{c.label()} ({ms(c)}, {s.drop_text(c)})" for c in rivals)
    over = [c for c in s.metrics if not s.meets(c)]
    if over:
        text += "; over the budget: " + ", ".join(f"{c.label()} ({s.drop_text(c)})" for c in over)
    if s.failed:
        text += "; failed: " + ", ".join(c.label() for c in s.failed)
    return text


@torch.no_grad()
def search(
    model: torch.nn.Module,
    calibration: list,
    eval_fn: Callable[[torch.nn.Module], float | PerWindow],
    max_drop: float,
    *,
    higher_is_better: bool = True,
    space: SearchSpace | None = None,
    time_fn: Callable[[torch.nn.Module], float] | None = None,
    prepare_kwargs: dict | None = None,
    cache: Calibrations | None = None,
    quiet: bool = False,
    confidence: float = CONFIDENCE,
) -> SearchResult:
    """The fastest measured config whose ``eval_fn`` drop vs the float ``model`` is <= max_drop.

    ``calibration``: batches (tensor, args tuple or kwargs dict). ``eval_fn(model)`` should use
    data the final report does not (a validation split) and return a float, or ``PerWindow``
    scores (``qfuse.tools.margin``): then a candidate meets the budget only when its drop plus
    the noise margin (the one-sided ``confidence`` upper bound of the paired per-window
    differences vs float) is <= max_drop. ``time_fn(qmodel) -> ms`` defaults to the CPU median
    of a forward on ``calibration[0]``. ``prepare_kwargs``: extra ``qfuse.prepare`` arguments
    (``dynamic_shapes``).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
        >>> data = [torch.randn(32, 16) for _ in range(2)]
        >>> ref = model(data[1])
        >>> score = lambda m: -(m(data[1]) - ref).pow(2).mean().item()  # higher is better
        >>> r = qfuse.search(model, data, score, max_drop=1e-3, quiet=True,
        ...                  space=qfuse.SearchSpace(dtypes=("int8",)))
        >>> r.drop <= 1e-3, r.config.dtype
        (True, torch.int8)
        >>> prepared = qfuse.prepare(model, r.config, (data[0],), **r.prepare_kwargs())
        >>> for x in data: _ = prepared(x)
        >>> qmodel = qfuse.convert(prepared, **r.convert_kwargs())
    """
    space = space or SearchSpace()
    if max_drop < 0:
        raise QFuseError(f"max_drop={max_drop}: the allowed metric drop must be >= 0.")
    if not 0.5 <= confidence < 1:
        raise QFuseError(f"confidence={confidence}: the margin's one-sided confidence, in "
                         "[0.5, 1) (0.5: no margin; 0.95 by default).")
    cache = cache or Calibrations(model, calibration, prepare_kwargs, quiet=quiet)
    if time_fn is None:
        example = cache.batches[0]
        time_fn = lambda m: median_ms(  # noqa: E731
            lambda: call(m, example), torch.device("cpu"), warmup=1, repeats=5
        )
    s = _Search(cache, eval_fn, max_drop, higher_is_better, time_fn, quiet, confidence)
    s.scores = eval_fn(model)
    s.baseline = float(s.scores)
    s.note("float", f"float baseline metric {s.baseline:.6g}; budget: drop + margin <= "
                    f"{max_drop:g}; {rule(s.scores, confidence)}")

    names = {k: scheme_name(*k) for k in space.schemes()}
    plain = {k: Candidate(plain_config(*k)) for k in space.schemes()}
    for c in plain.values():
        s.evaluate("plain (speed probe)", c, timed=True)
    _retime(s, list(plain.values()))
    for k in [k for k in plain if plain[k] not in s.latency]:
        s.note(names[k], f"plain {names[k]} failed: {names[k]} left out of the search")
    order = sorted((k for k in plain if plain[k] in s.latency), key=lambda k: s.latency[plain[k]])
    winners: list[Candidate] = []
    fallback: dict[Candidate, FallbackResult] = {}
    for k in order:
        d, name = k[0], names[k]
        if winners:
            # timed minutes apart on a shared machine: compare them side by side first
            quickest = min(winners, key=lambda w: s.latency[w])
            _retime(s, [plain[k], quickest])
            fastest = s.latency[quickest]
            if s.latency[plain[k]] >= fastest:
                s.note(
                    name,
                    f"pruned: plain {name} ({s.latency[plain[k]]:.3g} ms) is not faster than "
                    f"{quickest.label()}, which already meets the budget ({fastest:.3g} ms; "
                    "both re-timed interleaved)",
                )
                continue
        best = _climb(s, plain[k], space, d, k[1])
        if s.meets(best):
            if best != plain[k]:
                s.evaluate("meets budget", best, timed=True)
            if best in s.latency:
                winners.append(best)
                continue
        if not space.auto_fallback:
            s.note(name, f"best {name} misses the budget and auto_fallback is off")
            continue
        c = _fallback(s, best, space, higher_is_better, fallback)
        if c is not None and s.meets(c) and c in s.latency:
            winners.append(c)
        cache.keep_only(
            {key_of(w.config, w.smoothquant, w.gptq, w.smoothquant_layers) for w in winners}
        )
    if not winners:
        failed = ""
        if s.failed:
            failed = f"; {len(s.failed)} candidates raised, first: {next(iter(s.failed.values()))}"
        closest = sorted(s.metrics, key=s.worst)[:3]
        raise SearchError(
            f"qfuse.search: no configuration meets max_drop={max_drop} (closest, drop + "
            f"margin: {'; '.join(f'{c.label()}: {s.drop_text(c)}' for c in closest)}"
            f"{failed}; {rule(s.scores, confidence)}); raise max_drop, or "
            + ("raise the SearchSpace's fallback_fraction (auto_fallback's layer budget)."
               if space.auto_fallback and space.fallback_fraction is not None
               else "enable auto_fallback in the SearchSpace." if not space.auto_fallback
               else "widen the SearchSpace."),
            s.path,
        )
    win = _pick(s, winners)
    m = s.metrics[win]
    why = _why(s, win, winners)
    s.note("picked", why)
    return SearchResult(
        win,
        s.models[win],
        s.baseline,
        m,
        s.drop(m),
        s.latency[win],
        max_drop,
        s.path,
        fallback.get(win),
        why,
        s.margins.get(win, 0.0),
        rule(s.scores, confidence),
    )
