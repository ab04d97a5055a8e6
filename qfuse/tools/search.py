"""``qfuse.search``: the fastest calibration setup whose metric drop meets a budget, measured.

The space is dtype (int8/fp8 static) x observer x symmetric x SmoothQuant alpha x GPTQ x
auto_fallback. Observer, SmoothQuant and GPTQ change accuracy but not the kernels that run, so
speed is decided by the dtype and the layers kept float. The search therefore:

1. measures the plain candidate of each dtype (MinMax, symmetric): metric and latency, and
   visits dtypes fastest first;
2. per dtype, climbs accuracy only while the budget is unmet: observer x symmetric, then
   SmoothQuant alphas (stopping when a larger alpha stops helping), then GPTQ — a step is kept
   only if it measured better;
3. if still short, ``qfuse.auto_fallback`` keeps the fewest layers float (slower, so measured);
4. prunes a dtype whose plain latency is already slower than a config that meets the budget.

Every evaluation is a step of ``SearchResult.path``; the winner is the fastest that met the budget,
re-timed against the other winners in interleaved rounds; within ``timing.NOISE_MARGIN`` of the
fastest, the better metric wins (the same inputs give the same choice, timing noise aside).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from qfuse.algorithms.gptq import GPTQ
from qfuse.algorithms.smoothquant import SmoothQuant
from qfuse.analysis.fallback import FallbackResult, auto_fallback
from qfuse.analysis.sensitivity import call
from qfuse.config import QConfig
from qfuse.errors import QFuseError
from qfuse.flows.convert import convert
from qfuse.tools.calibrate import Calibrations, key_of, progress
from qfuse.tools.timing import error_text, fastest, median_ms, repeated_ms

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class SearchError(QFuseError):
    """No candidate met the budget; ``path`` holds every step the search took."""

    def __init__(self, message: str, path: list) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class SearchSpace:
    """What ``search`` may try. ``symmetric=(True, False)`` applies to int8 (fp8 is symmetric)."""

    dtypes: tuple[str, ...] = ("int8", "fp8")
    observers: tuple[str, ...] = ("minmax", "histogram_mse", "percentile")
    symmetric: tuple[bool, ...] = (True, False)
    smoothquant_alphas: tuple[float, ...] = (0.5, 0.75)
    gptq: bool = True
    auto_fallback: bool = True

    def __post_init__(self) -> None:
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown or not self.dtypes:
            raise QFuseError(f"SearchSpace dtypes {self.dtypes}: choose from {tuple(DTYPES)}.")


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
    """

    config: QConfig
    smoothquant: float | None = None
    gptq: bool = False
    keep_float: tuple[str, ...] = ()

    def label(self) -> str:
        dtype = "int8" if self.config.dtype == torch.int8 else "fp8"
        sym = ""
        if self.config.dtype == torch.int8:
            sym = " sym" if self.config.symmetric else " asym"
        text = f"{dtype} static, {self.config.observer}{sym}"
        if self.smoothquant is not None:
            text += f" + SmoothQuant {self.smoothquant:g}"
        if self.gptq:
            text += " + GPTQ"
        if self.keep_float:
            text += f" + auto_fallback ({len(self.keep_float)} float)"
        return text

    def prepare_kwargs(self) -> dict:
        """Keyword arguments for ``qfuse.prepare`` besides the config."""
        out: dict = {}
        if self.smoothquant is not None:
            out["smoothquant"] = SmoothQuant(self.smoothquant)
        if self.gptq:
            out["gptq"] = GPTQ()
        return out

    def convert_kwargs(self) -> dict:
        """Keyword arguments for ``qfuse.convert``."""
        if not self.keep_float:
            return {}
        return {"keep_float": {n: "qfuse.search: auto_fallback" for n in self.keep_float}}

    def to_dict(self) -> dict:
        return {
            "label": self.label(),
            "config": self.config.to_dict(),
            "smoothquant_alpha": self.smoothquant,
            "gptq": self.gptq,
            "keep_float": list(self.keep_float),
        }


@dataclass
class Step:
    stage: str
    candidate: str
    metric: float | None
    drop: float | None
    latency_ms: float | None
    meets: bool
    note: str = ""


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
    fallback: FallbackResult | None = None

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
            "evaluations": len(self.path),
            "path": [asdict(s) for s in self.path],
        }


class _Search:
    def __init__(self, cache, eval_fn, max_drop, higher_is_better, time_fn, quiet):
        self.cache, self.eval_fn, self.max_drop = cache, eval_fn, max_drop
        self.sign = 1.0 if higher_is_better else -1.0
        self.time_fn, self.quiet = time_fn, quiet
        self.path: list[Step] = []
        self.metrics: dict[Candidate, float] = {}
        self.latency: dict[Candidate, float] = {}
        self.models: dict[Candidate, torch.nn.Module] = {}
        self.baseline = 0.0
        self.failed: dict[Candidate, str] = {}

    def drop(self, metric: float) -> float:
        return self.sign * (self.baseline - metric)

    def meets(self, c: Candidate) -> bool:
        return c in self.metrics and self.drop(self.metrics[c]) <= self.max_drop

    def prepared(self, c: Candidate):
        return self.cache.get(c.config, c.smoothquant, c.gptq)

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
                self.metrics[c] = float(self.eval_fn(qmodel))
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
        step = Step(stage, c.label(), m, self.drop(m), self.latency.get(c), self.meets(c), note)
        self.path.append(step)
        if not self.quiet:
            ms = "" if step.latency_ms is None else f", {step.latency_ms:.3g} ms"
            print(
                f"search [{stage}] {step.candidate}: {m:.6g} (drop {step.drop:.3g}{ms})",
                file=sys.stderr,
                flush=True,
            )
        return m

    def better(self, a: Candidate, b: Candidate) -> bool:
        if a not in self.metrics:
            return False
        return b not in self.metrics or self.sign * (self.metrics[a] - self.metrics[b]) > 0

    def note(self, stage: str, text: str) -> None:
        self.path.append(Step(stage, "", None, None, None, False, text))


def _climb(s: _Search, start: Candidate, space: SearchSpace, dtype: str) -> Candidate:
    """Accuracy steps on one dtype while the budget is unmet; returns the best measured."""
    best = start
    schemes = [
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
    for alpha in space.smoothquant_alphas:
        if s.meets(best):
            return best
        c = replace(best, smoothquant=alpha)
        s.evaluate("SmoothQuant", c)
        if not s.better(c, best):
            s.note("SmoothQuant", f"alpha {alpha:g} did not improve: stop raising alpha")
            break
        best = c
    if space.gptq and not s.meets(best):
        c = replace(best, gptq=True)
        s.evaluate("GPTQ", c)
        if s.better(c, best):
            best = c
    return best


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
    rank = {k: (s.sign * -s.metrics[c],) for k, c in by_label.items()}
    return by_label[fastest(times, rank)]


@torch.no_grad()
def search(
    model: torch.nn.Module,
    calibration: list,
    eval_fn: Callable[[torch.nn.Module], float],
    max_drop: float,
    *,
    higher_is_better: bool = True,
    space: SearchSpace | None = None,
    time_fn: Callable[[torch.nn.Module], float] | None = None,
    prepare_kwargs: dict | None = None,
    cache: Calibrations | None = None,
    quiet: bool = False,
) -> SearchResult:
    """The fastest measured config whose ``eval_fn`` drop vs the float ``model`` is <= max_drop.

    ``calibration``: batches (tensor, args tuple or kwargs dict). ``eval_fn(model) -> float``
    should use data the final report does not (a validation split). ``time_fn(qmodel) -> ms``
    defaults to the CPU median of a forward on ``calibration[0]``. ``prepare_kwargs``: extra
    ``qfuse.prepare`` arguments (``dynamic_shapes``).

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
    cache = cache or Calibrations(model, calibration, prepare_kwargs, quiet=quiet)
    if time_fn is None:
        example = cache.batches[0]
        time_fn = lambda m: median_ms(  # noqa: E731
            lambda: call(m, example), torch.device("cpu"), warmup=1, repeats=5
        )
    s = _Search(cache, eval_fn, max_drop, higher_is_better, time_fn, quiet)
    s.baseline = float(eval_fn(model))
    s.note("float", f"float baseline metric {s.baseline:.6g}; budget: drop <= {max_drop:g}")

    plain = {d: Candidate(QConfig(dtype=DTYPES[d])) for d in space.dtypes}
    for c in plain.values():
        s.evaluate("plain (speed probe)", c, timed=True)
    for d in [d for d in space.dtypes if plain[d] not in s.latency]:
        s.note(d, f"plain {d} failed: {d} left out of the search")
    order = sorted(
        (d for d in space.dtypes if plain[d] in s.latency), key=lambda d: s.latency[plain[d]]
    )
    winners: list[Candidate] = []
    fallback: dict[Candidate, FallbackResult] = {}
    for d in order:
        fastest = min((s.latency[w] for w in winners), default=None)
        if fastest is not None and s.latency[plain[d]] >= fastest:
            s.note(
                d,
                f"pruned: plain {d} ({s.latency[plain[d]]:.3g} ms) is not faster than "
                f"a config that already meets the budget ({fastest:.3g} ms)",
            )
            continue
        best = _climb(s, plain[d], space, d)
        if s.meets(best):
            if best != plain[d]:
                s.evaluate("meets budget", best, timed=True)
            if best in s.latency:
                winners.append(best)
                continue
        if not space.auto_fallback:
            s.note(d, f"best {d} misses the budget and auto_fallback is off")
            continue
        try:
            qmodel, fb = auto_fallback(
                s.prepared(best), eval_fn, max_drop, higher_is_better=higher_is_better,
                quiet=s.quiet,
            )
        except Exception as exc:  # noqa: BLE001 — a failed fallback leaves the other dtypes
            s.note("auto_fallback", f"{best.label()}: {error_text(exc)}")
            continue
        c = replace(best, keep_float=tuple(sorted(fb.kept_float)))
        s.metrics[c], s.models[c] = float(fb.metric), qmodel
        fallback[c] = fb
        s.evaluate("auto_fallback", c, timed=True, note=f"{fb.evaluations} evaluations inside")
        if s.meets(c) and c in s.latency:
            winners.append(c)
        cache.keep_only({key_of(w.config, w.smoothquant, w.gptq) for w in winners})
    if not winners:
        failed = ""
        if s.failed:
            failed = f"; {len(s.failed)} candidates raised, first: {next(iter(s.failed.values()))}"
        raise SearchError(
            f"qfuse.search: no configuration meets max_drop={max_drop} (smallest drops: "
            f"{[round(x, 6) for x in sorted(s.drop(m) for m in s.metrics.values())[:3]]}"
            f"{failed}); raise max_drop or enable auto_fallback in the "
            "SearchSpace.",
            s.path,
        )
    win = _pick(s, winners)
    m = s.metrics[win]
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
    )
