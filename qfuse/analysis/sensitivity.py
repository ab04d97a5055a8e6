"""``qfuse.sensitivity``: how much each layer alone loses when quantized.

Two methods, both ranking the layers most sensitive first:

- ``method="full"`` (the default, the more faithful): for every fusible layer the prepared
  (calibrated) model is converted with only that layer quantized; the report gives the SQNR of
  the *model output* against float on the given batches, and the change of the user's metric
  when an ``eval_fn`` is given. It sees how a layer's error propagates through the rest of the
  model, at the price of one convert (and one evaluation) per layer: 119 on SmolLM2-135M, about
  14 minutes on a CPU.
- ``method="local"``: one forward of the float model records every layer's input on the batches;
  each layer's *own output* (its Linear/conv before the activation) is then computed in float
  and with its weight and input fake-quantized as convert would quantize them (the plan's
  SmoothQuant factors, GPTQ-rounded weights and weight scales, and its static input qparams or
  per-token dynamic scales), and the report gives that output's SQNR. No convert per layer, no
  metric: it measures how much a layer loses on its own inputs, not how much that costs the
  model downstream.

The float baseline is the prepared model with its observers switched off, so measuring never
disturbs calibration.
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
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.observers.base import observers_disabled
from qfuse.progress import progress
from qfuse.state import get_state

METHODS = ("full", "local")
LOCAL_ROWS = 2048  # rows (tokens) of each Linear input the local method keeps, evenly spaced


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
    method: str = "full",
) -> SensitivityReport:
    """Per-layer quantization error: each fusible layer quantized alone.

    ``method``: "full" converts the model once per layer and measures the model output (and
    ``eval_fn``); "local" measures each layer's own output SQNR on the inputs it receives from
    ``data``, its weight and input fake-quantized in place, with no convert per layer (see the
    module's docstring for what each measures). "local" needs ``data`` and takes no ``eval_fn``.

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
    if method not in METHODS:
        raise QFuseError(f"qfuse.sensitivity method={method!r}: choose from {METHODS}.")
    if data is None and eval_fn is None:
        raise QFuseError("qfuse.sensitivity needs data (batches) or an eval_fn to measure with.")
    if method == "local" and (data is None or eval_fn is not None):
        raise QFuseError(
            "qfuse.sensitivity(method='local') measures each layer's output SQNR on data: pass "
            "data (batches) and no eval_fn (method='full' measures a metric)."
        )
    batches = list(data) if data is not None else []
    prepared = _prepared(model, config, batches, quiet)
    state = get_state(prepared)
    if method == "local":
        return _local(prepared, state, batches, layers, quiet)
    with observers_disabled(prepared):
        reference = [call(prepared, b) for b in batches]
        baseline = eval_fn(prepared) if eval_fn is not None else None
    names = [c.name for c in state.chains]
    rows = []
    chains = _select(state, layers)
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


def _select(state, layers) -> list:
    names = [c.name for c in state.chains]
    selected = list(layers) if layers is not None else names
    unknown = sorted(set(selected) - set(names))
    if unknown:
        raise QFuseError(f"qfuse.sensitivity layers {unknown} are not quantizable layers of this "
                         f"model; choose from {names[:8]}{' ...' if len(names) > 8 else ''}.")
    return [c for c in state.chains if c.name in selected]


def _record_inputs(prepared, state, batches) -> dict[str, torch.Tensor]:
    """Chain input node -> the float values it carried on ``batches`` (observers off): a Linear's
    as rows [N, K] (at most ``LOCAL_ROWS``, evenly spaced), a conv's as its NCHW batches."""
    conv_inputs = {c.input for c in state.chains if c.kind != "linear"}
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for src, module_name in state.observers.items():
        def hook(_module, args, src=src):
            x = args[0].detach().float()
            seen.setdefault(src, []).append(x if src in conv_inputs else x.reshape(-1, x.shape[-1]))
        hooks.append(prepared.get_submodule(module_name).register_forward_pre_hook(hook))
    try:
        with observers_disabled(prepared):
            for b in batches:
                call(prepared, b)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for src, xs in seen.items():
        x = torch.cat(xs)
        if src not in conv_inputs and x.shape[0] > LOCAL_ROWS:
            x = x[torch.linspace(0, x.shape[0] - 1, LOCAL_ROWS).round().long()]
        out[src] = x
    return out


def _fake_input(x, chain, plan, config) -> torch.Tensor:
    """The values the quantized layer computes with: ``x`` (already divided by SmoothQuant's
    factors) quantized as convert's layer would, then dequantized."""
    from qfuse.ops.qconv2d import dynamic_input_qparams
    from qfuse.ops.reference import quantize_fp8, quantize_int8, quantize_per_token

    dtype = plan.dtypes[chain.name]
    scale, zero_point = plan.x_qparams[chain.name]
    if chain.name in plan.dynamic or scale is None:
        if chain.kind == "linear":
            q, row_scale = quantize_per_token(x, dtype)
            return q.float() * row_scale[:, None]
        scale, _ = dynamic_input_qparams(x, dtype)
        zero_point = None
    inv = torch.reciprocal(scale.float())
    if dtype == torch.float8_e4m3fn:
        return quantize_fp8(x, inv).float() * scale
    zp = zero_point.float() if zero_point is not None else 0.0
    return (quantize_int8(x, inv, zp).float() - zp) * scale


def _layer_output(chain, x, weight, bias) -> torch.Tensor:
    if chain.kind == "linear":
        return torch.nn.functional.linear(x, weight, bias)
    conv = chain.conv or {}
    return torch.nn.functional.conv2d(x, weight, bias, conv.get("stride", 1),
                                      conv.get("padding", 0), conv.get("dilation", 1),
                                      conv.get("groups", 1))


def _local(prepared, state, batches: list, layers, quiet: bool) -> SensitivityReport:
    """``method="local"``: every selected layer's own output SQNR, float vs fake-quantized."""
    from qfuse.config import PerChannel
    from qfuse.flows.plan import LayerPlan
    from qfuse.primitives import weight_codes, weight_scale

    if state.config.weight_bits != 8:
        raise QFuseError("qfuse.sensitivity(method='local') measures 8-bit configs; use "
                         "method='full' for 4-bit weights.")
    chains = _select(state, layers)
    inputs = _record_inputs(prepared, state, batches)
    dtypes = {c.name: state.config.dtype for c in state.chains}
    hessians = {c.name: prepared.get_submodule(state.hessians[c.name])
                for c in state.chains if c.name in state.hessians}
    plan = LayerPlan(prepared, state, state.chains, state.observers, dtypes, hessians,
                     fold_norms=True)
    per_channel = isinstance(state.config.weight_granularity, PerChannel)
    # a SmoothQuant factor folded into a Linear's rows (a producer's, up's) divides its outputs
    unfold = plan.row_divisors
    rows = []
    for chain in progress(chains, "sensitivity (local)", quiet):
        x = inputs.get(chain.input)
        if x is None or x.numel() == 0:
            rows.append(LayerSensitivity(chain.name, chain.pattern, None, None, None))
            continue
        w0 = attr_tensor(prepared, chain.weight).detach().float()
        b0 = attr_tensor(prepared, chain.bias).detach().float() if chain.bias else None
        reference = _layer_output(chain, x, w0, b0)
        channel = -1 if chain.kind == "linear" else 1
        xs = x
        s = plan.smoothing.get(chain.name)
        if s is not None:
            shape = [1] * x.dim()
            shape[channel] = -1
            xs = x / s.reshape(shape)
        dtype = plan.dtypes[chain.name]
        w = plan.weights[chain.name]
        scale = plan.weight_scales.get(chain.name)
        if scale is None:
            scale = weight_scale(w, dtype, per_channel)
        flat = w.reshape(w.shape[0], -1)
        wq = (weight_codes(flat, torch.reciprocal(scale)[:, None], dtype) * scale[:, None])
        out = _layer_output(chain, _fake_input(xs, chain, plan, state.config),
                            wq.reshape(w.shape), plan.biases[chain.name])
        if chain.name in unfold:
            shape = [1] * out.dim()
            shape[channel] = -1
            out = out * unfold[chain.name].reshape(shape)
        rows.append(LayerSensitivity(chain.name, chain.pattern,
                                     output_sqnr_db([reference], [out]), None, None))
    return SensitivityReport(None, rows)
