"""``qfuse.sensitivity``: how much each layer alone loses when quantized.

For every fusible layer the prepared (calibrated) model is converted with only that layer
quantized; the report gives the SQNR of the model output against float on the given batches, and
the change of the user's metric when an ``eval_fn`` is given. The float baseline is the prepared
model with its observers switched off, so measuring never disturbs calibration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from qfuse.analysis.table import text_table
from qfuse.config import QConfig
from qfuse.errors import QFuseError
from qfuse.fileio import atomic_savefig
from qfuse.flows.convert import convert
from qfuse.flows.prepare import prepare
from qfuse.observers.base import observers_disabled
from qfuse.progress import progress
from qfuse.state import get_state


def split_batch(batch) -> tuple[tuple, dict]:
    """(args, kwargs) of one batch given as a tensor, a tuple of args or a dict of kwargs."""
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def call(model, batch):
    """Run ``model`` on one batch (see ``split_batch``)."""
    args, kwargs = split_batch(batch)
    return model(*args, **kwargs)


def _float_leaves(out) -> torch.Tensor:
    leaves = [
        t.detach().double().flatten()
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return torch.cat(leaves) if leaves else torch.zeros(0, dtype=torch.float64)


def output_sqnr_db(reference: list, outputs: list) -> float:
    """SQNR (dB) of all float outputs, concatenated: 10 log10(|ref|^2 / |ref - out|^2)."""
    ref = torch.cat([_float_leaves(r) for r in reference])
    out = torch.cat([_float_leaves(o) for o in outputs])
    noise = (ref - out.to(ref.device)).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


@dataclass
class LayerSensitivity:
    name: str
    pattern: str
    sqnr_db: float | None
    metric: float | None
    drop: float | None  # baseline - metric (higher_is_better) or metric - baseline


@dataclass
class SensitivityReport:
    baseline: float | None
    rows: list[LayerSensitivity]

    def ranked(self) -> list[LayerSensitivity]:
        """Most sensitive first: by metric drop when measured, else by lowest SQNR; ties by name."""

        def key(r):
            primary = -r.drop if r.drop is not None else (r.sqnr_db if r.sqnr_db is not None else 0)
            return (primary, r.name)

        return sorted(self.rows, key=key)

    def to_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    def __str__(self) -> str:
        fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
        rows = [
            [r.name, r.pattern, fmt(r.sqnr_db, ".2f"), fmt(r.metric, ".5f"), fmt(r.drop, ".5f")]
            for r in self.ranked()
        ]
        text = text_table(["layer", "pattern", "SQNR dB", "metric", "drop"], rows, right={2, 3, 4})
        if self.baseline is not None:
            text += f"\nfloat baseline metric: {self.baseline:.5f}"
        return text

    def plot(self, path: str) -> str:
        """Bar chart of per-layer sensitivity (PNG), written atomically; returns ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.ranked()
        use_drop = any(r.drop is not None for r in rows)
        values = [(r.drop if use_drop else r.sqnr_db) or 0.0 for r in rows]
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.22 * len(rows))))
        ax.barh([r.name for r in rows][::-1], values[::-1], color="#4c72b0")
        ax.set_xlabel(
            "metric drop with only this layer quantized"
            if use_drop
            else "output SQNR (dB) with only this layer quantized"
        )
        ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        try:
            atomic_savefig(fig, path, dpi=120)
        finally:
            plt.close(fig)
        return path


def _prepared(model, config, batches: list, quiet: bool = False) -> fx.GraphModule:
    """``model`` itself when it is a prepared model, else ``model`` prepared with ``config`` and
    calibrated on ``batches``."""
    state = get_state(model)
    if state is not None:
        if state.stage != "prepared":
            raise QFuseError(
                "qfuse.sensitivity takes a float model (with a config) or the model returned by "
                "qfuse.prepare, not a converted one."
            )
        return model
    if not isinstance(config, QConfig):
        raise QFuseError(
            "qfuse.sensitivity on a float model needs config=qfuse.QConfig(...) (got "
            f"{type(config).__name__}) and data to calibrate with; or pass a prepared model."
        )
    if not batches:
        raise QFuseError("qfuse.sensitivity on a float model needs data: its calibration batches.")
    args, kwargs = split_batch(batches[0])
    prepared = prepare(model, config, args, example_kwargs=kwargs or None)
    for batch in progress(batches, "calibrating", quiet):
        call(prepared, batch)
    return prepared


@torch.no_grad()
def sensitivity(
    model: torch.nn.Module,
    config: QConfig | None = None,
    data: Iterable | None = None,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
    *,
    higher_is_better: bool = True,
    layers: Iterable[str] | None = None,
    quiet: bool = False,
) -> SensitivityReport:
    """Per-layer quantization error: each fusible layer quantized alone.

    ``model``: a calibrated ``qfuse.prepare`` result, or a float model with its ``config`` (it
    is then prepared and calibrated on ``data``). ``data``: batches (tensor, args tuple or kwargs
    dict) for output SQNR; ``eval_fn(model) -> float``: the user's metric. At least one is needed.
    ``layers``: the layer names to measure (default all). A bar shows the layers measured
    (``quiet=True``, or stderr not a terminal, hides it).

    Example:
        >>> import torch, qfuse
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> x = torch.randn(16, 8)
        >>> prepared = qfuse.prepare(model, qfuse.QConfig.int8_static(), (x,))
        >>> _ = prepared(x)
        >>> report = qfuse.sensitivity(prepared, data=[x])
        >>> sorted(r.name for r in report.rows)
        ['0', '2']
        >>> same = qfuse.sensitivity(model, qfuse.QConfig.int8_static(), data=[x])  # float model
        >>> [r.sqnr_db for r in same.rows] == [r.sqnr_db for r in report.rows]
        True
    """
    if data is None and eval_fn is None:
        raise QFuseError("qfuse.sensitivity needs data (batches) or an eval_fn to measure with.")
    batches = list(data) if data is not None else []
    prepared = _prepared(model, config, batches, quiet)
    state = get_state(prepared)
    with observers_disabled(prepared):
        reference = [call(prepared, b) for b in batches]
        baseline = eval_fn(prepared) if eval_fn is not None else None
    names = [c.name for c in state.chains]
    selected = list(layers) if layers is not None else names
    unknown = sorted(set(selected) - set(names))
    if unknown:
        raise QFuseError(f"qfuse.sensitivity layers {unknown} are not quantizable layers of this "
                         f"model; choose from {names[:8]}{' ...' if len(names) > 8 else ''}.")
    rows = []
    chains = [c for c in state.chains if c.name in selected]
    for chain in progress(chains, "sensitivity", quiet):
        others = {n: "sensitivity probe" for n in names if n != chain.name}
        qmodel = convert(prepared, keep_float=others)
        sqnr = output_sqnr_db(reference, [call(qmodel, b) for b in batches]) if batches else None
        metric = eval_fn(qmodel) if eval_fn is not None else None
        drop = None
        if metric is not None:
            drop = (baseline - metric) if higher_is_better else (metric - baseline)
        rows.append(LayerSensitivity(chain.name, chain.pattern, sqnr, metric, drop))
    return SensitivityReport(baseline, rows)
