"""``run_sweep``: each config of a recipe measured in isolation, the report rewritten after each.

Per config: calibrate (cached), convert, evaluate the recipe's metric, time the forward per mode
on the device, count launches, save to a temp dir for the size on disk, and count the layers fused
and kept float. A config that raises becomes a row with its error; after every row the report
directory is rewritten atomically, so an interrupted sweep keeps what it measured. On the CPU
the eager latencies are taken again at the end, all configs interleaved (``Sweep.retime``).
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.utils import _pytree as pytree

from qfuse.analysis.sensitivity import call
from qfuse.analysis.summary import summary
from qfuse.config import QConfig
from qfuse.errors import BackendError, QFuseError, UnsupportedError
from qfuse.export import save
from qfuse.flows.convert import convert
from qfuse.state import get_state
from qfuse.tools.calibrate import Calibrations, progress
from qfuse.tools.margin import CONFIDENCE
from qfuse.tools.recipes import SweepSpec
from qfuse.tools.report import write_report
from qfuse.tools.search import SearchError, SearchSpace, search
from qfuse.tools.timing import MODES, error_text, graphed, latency, median_ms, repeated_ms

PRESETS: dict[str, Callable[[], QConfig]] = {
    "int8_static": QConfig.int8_static,
    "int8_dynamic": QConfig.int8_dynamic,
    "fp8_static": QConfig.fp8_static,
    "fp8_dynamic": QConfig.fp8_dynamic,
}
CONFIGS = ("fp32", "bf16", *PRESETS, "best")
RETIME_ROUNDS = 3  # CPU: every config's eager median, taken this many times, interleaved


class OnDevice(torch.nn.Module):
    """Runs ``model`` on ``device`` (floating inputs cast to ``dtype``) for a recipe's metric,
    which calls it with CPU batches: outputs come back as CPU float32."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype=None):
        super().__init__()
        self.model, self.device, self.dtype = model, device, dtype

    def move(self, tree):
        def one(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.to(self.device)
            return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

        return pytree.tree_map(one, tree)

    def forward(self, *args, **kwargs):
        out = self.model(*self.move(args), **self.move(kwargs))
        back = lambda t: (  # noqa: E731
            t.cpu().float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        )
        return pytree.tree_map(back, out)


def _size_bytes(model: torch.nn.Module) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        if get_state(model) is not None:
            save(model, path)
        else:
            from safetensors.torch import save_model

            save_model(model, path)
        return os.path.getsize(path)


def _layers(model: torch.nn.Module) -> tuple[int | None, int | None]:
    if get_state(model) is None:
        return None, None
    rows = summary(model).rows
    kept = sum(1 for r in rows if r["precision"] == "float")
    return len(rows) - kept, kept


class Sweep:
    """State shared by the configs of one sweep (the calibration cache, the fp32 metric)."""

    def __init__(self, spec: SweepSpec, device, max_drop, modes, repeats, space, quiet,
                 confidence=CONFIDENCE):
        self.spec, self.device, self.max_drop = spec, torch.device(device), max_drop
        self.modes, self.repeats, self.space, self.quiet = modes, repeats, space, quiet
        self.confidence = confidence
        self.cache = Calibrations(spec.model, spec.calibration, spec.prepare_kwargs, quiet)
        self.search_result = None
        self.timed: dict[str, tuple] = {}  # config -> (model, batch), for ``retime``

    def on_device(self, model: torch.nn.Module) -> torch.nn.Module:
        """A converted model moves; the float model and prepared ones (cached, calibrated on
        CPU, re-converted by auto_fallback) are copied so that they stay where they are."""
        if self.device.type == "cpu":
            return model
        state = get_state(model)
        if state is None or state.stage == "prepared":
            return copy.deepcopy(model).to(self.device)
        return model.to(self.device)

    def example(self, dtype=None):
        return OnDevice(torch.nn.Identity(), self.device, dtype).move(self.spec.example)

    def model_for(self, name: str) -> tuple[torch.nn.Module, torch.dtype | None, str]:
        spec = self.spec
        if name == "fp32":
            return copy.deepcopy(spec.model).to(self.device), None, "float32"
        if name == "bf16":
            model = copy.deepcopy(spec.model).to(self.device, torch.bfloat16)
            return model, torch.bfloat16, "bfloat16 weights and activations"
        if name in PRESETS:
            return convert(self.cache.get(PRESETS[name]())).to(self.device), None, name
        if name == "best":

            def time_fn(qmodel):
                return self.ms(qmodel.to(self.device), self.example())

            validate = lambda m: spec.validate(OnDevice(self.on_device(m), self.device))  # noqa: E731
            r = search(
                spec.model,
                spec.calibration,
                validate,
                self.max_drop,
                higher_is_better=spec.higher_is_better,
                space=self.space,
                time_fn=time_fn,
                cache=self.cache,
                quiet=self.quiet,
                confidence=self.confidence,
            )
            self.search_result = r
            # The row is the search's winner, whatever a float model would time here: the
            # table's speed-up column and the fp32 row say that (it reported bf16, which
            # nobody asked for, when bf16 timed faster on the CPU).
            return r.qmodel.to(self.device), None, r.candidate.label()
        raise QFuseError(f"unknown sweep config {name!r}; choose from {', '.join(CONFIGS)}.")

    def ms(self, model, batch) -> float:
        """How ``best`` times a model: on a GPU by CUDA-graph replays when the sweep times the
        graph mode (eager calls there are bound by host launch cost, which would rank configs by
        their kernel count, not their GPU time), else by eager calls."""
        fn = lambda: call(model, batch)  # noqa: E731
        if self.device.type == "cuda" and "graph" in self.modes:
            try:
                fn = graphed(fn, self.device)
            except Exception:  # noqa: BLE001 — a model that cannot be captured is timed eager
                torch.cuda.synchronize(self.device)
        return median_ms(fn, self.device, max(1, self.repeats // 3), self.repeats)

    @torch.no_grad()
    def retime(self, rows: list[dict]) -> None:
        """On the CPU, every row's eager latency again, the configs interleaved round by round
        (``repeated_ms``): a slow spell of a shared machine then slows every config alike, not
        the one timed during it (three one-pass sweeps of one recipe timed int8_static at 516,
        344 and 18.5 ms). On a GPU each row's ``do_bench`` median stands."""
        if self.device.type != "cpu" or len(self.timed) < 2:
            return
        def timer(model, batch):
            return lambda: median_ms(lambda: call(model, batch), self.device, 1, self.repeats)

        times = repeated_ms({k: timer(m, b) for k, (m, b) in self.timed.items()},
                            rounds=RETIME_ROUNDS)
        for row in rows:
            if row["config"] in times:
                row["latency_ms"]["eager"] = times[row["config"]]
                row["timing"] = f"median of {RETIME_ROUNDS} interleaved rounds"
        self.timed.clear()

    @torch.no_grad()
    def run(self, name: str) -> dict:
        row: dict = {"config": name}
        start = time.perf_counter()
        try:
            model, dtype, label = self.model_for(name)
            row["label"] = label
            row["metric"] = float(self.spec.evaluate(OnDevice(model, self.device, dtype)))
            times, errors, launches = latency(
                model, self.example(dtype), self.device, self.modes, self.repeats
            )
            row.update(latency_ms=times, launches=launches)
            if "eager" in times and self.device.type == "cpu":
                self.timed[name] = (model, self.example(dtype))  # re-timed at the end
            if errors:
                row["mode_errors"] = errors
            try:
                row["size_bytes"] = _size_bytes(model)
            except Exception as exc:  # noqa: BLE001 — a size we cannot take is not a failed row
                row["size_error"] = error_text(exc)
            row["fused"], row["kept_float"] = _layers(model)
        except Exception as exc:  # noqa: BLE001 — one failing config is a row, not a crash
            row["error"] = error_text(exc)
            if isinstance(exc, SearchError):
                row["search_path"] = [asdict(step) for step in exc.path]
            row["traceback"] = traceback.format_exc(limit=-8)[-4000:]
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row


def _derive(rows: list[dict], higher_is_better: bool) -> None:
    """Δ vs fp32 and speed-up vs fp32 per mode, for the rows that have them."""
    base = next((r for r in rows if r["config"] == "fp32" and "metric" in r), None)
    bf16 = next((r for r in rows if r["config"] == "bf16" and "metric" in r), None)

    def ratios(ref: dict, r: dict) -> dict:
        ref_ms = ref.get("latency_ms", {})
        return {m: ref_ms[m] / t for m, t in r.get("latency_ms", {}).items() if m in ref_ms and t}

    sign = 1.0 if higher_is_better else -1.0
    for r in rows:
        if "metric" not in r:
            continue
        if base is not None:
            r["delta"] = sign * (r["metric"] - base["metric"]) + 0.0  # no "-0.00000"
            r["speedup"] = ratios(base, r)
        if bf16 is not None:
            r["speedup_vs_bf16"] = ratios(bf16, r)


def run_sweep(
    spec: SweepSpec,
    configs: tuple[str, ...] | list[str] = CONFIGS,
    out: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    max_drop: float = 0.01,
    modes: tuple[str, ...] = MODES,
    repeats: int = 10,
    space: SearchSpace | None = None,
    quiet: bool = False,
    confidence: float = CONFIDENCE,
) -> dict:
    """Measure ``configs`` on ``spec`` and (when ``out`` is given) write the report directory.
    ``space``: what ``best`` searches (default: the spec's ``search_space``, else
    ``SearchSpace()``); ``confidence``: its noise margin's, when the spec's ``validate``
    returns per-window scores (``qfuse.search``).

    Returns the results dict that ``results.json`` holds (``rows``, ``environment``, ``search``).

    Example:
        >>> from qfuse.tools import load_spec, run_sweep
        >>> spec = load_spec("digits", reduced=True)
        >>> res = run_sweep(spec, ["fp32", "int8_static"], device="cpu", repeats=2, quiet=True)
        >>> [r["config"] for r in res["rows"]], "error" in res["rows"][1]
        (['fp32', 'int8_static'], False)
    """
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise QFuseError(f"unknown sweep configs {unknown}; choose from {', '.join(CONFIGS)}.")
    if not 0.5 <= confidence < 1:
        raise QFuseError(f"confidence={confidence}: best's noise margin takes a one-sided "
                         "confidence in [0.5, 1) (0.5: no margin).")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendError(f"device {device}: CUDA is not available on this machine (torch "
                           f"{torch.__version__}); sweep on the CPU with --device cpu.")
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"device {device}: the sweep runs on cpu or cuda.")
    space = space if space is not None else spec.search_space
    sweep = Sweep(spec, device, max_drop, tuple(modes), repeats, space, quiet, confidence)
    rows: list[dict] = []
    results = {
        "recipe": spec.name,
        "description": spec.description,
        "metric": spec.metric,
        "higher_is_better": spec.higher_is_better,
        "max_drop": max_drop,
        "configs": list(configs),
        "status": "running",
        "rows": rows,
    }

    def flush(status: str) -> None:
        results["status"] = status
        _derive(rows, spec.higher_is_better)
        if sweep.search_result is not None:
            results["search"] = sweep.search_result.to_dict()
        if out is not None:
            fb = sweep.search_result.fallback if sweep.search_result is not None else None
            write_report(out, results, sensitivity=fb.report if fb is not None else None)

    try:
        for name in progress(configs, f"sweep {spec.name}", quiet):
            rows.append(sweep.run(name))
            flush("running")
    except KeyboardInterrupt:
        flush("interrupted")
        raise
    sweep.retime(rows)
    flush("complete")
    return results
