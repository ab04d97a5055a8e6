"""``qfuse.summary``: one row per Linear/Conv2d of a prepared or converted model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from qfuse.analysis.table import text_table
from qfuse.errors import QFuseError
from qfuse.ops.backend import resolve_backend
from qfuse.state import get_state

COLUMNS = (
    "name",
    "pattern",
    "precision",
    "kernel",
    "input",
    "output",
    "x_scale",
    "w_scale",
    "out_scale",
    "note",
)


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class Summary:
    """``rows``: a list of dicts (keys ``COLUMNS``); ``str()`` renders them as a table."""

    rows: list[dict]

    def __str__(self) -> str:
        cols = [c for c in COLUMNS if any(_fmt(r.get(c)) for r in self.rows)]
        return text_table(cols, [[_fmt(r.get(c)) for c in cols] for r in self.rows])

    def __repr__(self) -> str:
        return str(self)


def _kernel(module) -> str:
    """The kernel that runs ``module`` on its device now; every fused module has a Triton kernel
    and may name it (``triton_kernel``), QLinear's is the GEMM."""
    device = module.weight.device
    try:
        backend = resolve_backend(device)
    except QFuseError as exc:
        return f"error: {exc}"
    triton_name = getattr(module, "triton_kernel", "triton qgemm")
    name = triton_name if backend.value == "triton" else "torch reference"
    plain = getattr(module, "_launch_cache", {}).get("plain")
    if plain and backend.value == "triton":  # the eager fast path fell back (kernels.launcher)
        return f"{name} ({device.type}; {plain})"
    return f"{name} ({device.type})"


def _pattern(state, model, name: str, pattern: str) -> str:
    """A Conv1d runs as a height-1 Conv2d; the summary names the layer the user wrote."""
    if not pattern.startswith("Conv2d"):
        return pattern
    from torch import nn

    from qfuse.nn.qconv1d import QConv1d

    layers = [model]
    if state.source is not None:
        layers.insert(0, state.source.model)
    for root in layers:
        for path in (name, name.rsplit(".", 1)[0] if name.endswith(".conv") else None):
            try:
                module = root.get_submodule(path) if path else None
            except AttributeError:
                continue
            if isinstance(module, (nn.Conv1d, QConv1d)):
                return "Conv1d" + pattern[len("Conv2d"):]
    return pattern


def summary(model: fx.GraphModule) -> Summary:
    """Per layer: the fused pattern, precision, the kernel that runs now, scales, and notes.

    Layers that stay float are listed too, with the reason.
    """
    state = get_state(model)
    if state is None:
        raise QFuseError(
            "qfuse.summary expects a model returned by qfuse.prepare or qfuse.convert."
        )
    rows: list[dict] = []
    if state.stage == "converted":
        for rec in state.layers:
            mod = model.get_submodule(rec.name)
            mod = getattr(mod, "merged_layer", mod)  # a QSibling: its merged GEMM's numbers
            out_scale = float(mod.out_scale) if mod.out_scale is not None else None
            rows.append(
                dict(
                    name=rec.name,
                    pattern=_pattern(state, model, rec.name, rec.pattern),
                    precision=rec.precision,
                    kernel=_kernel(mod),
                    input=rec.input,
                    output=rec.output,
                    x_scale=float(mod.x_scale) if mod.x_scale is not None else (
                        "float" if getattr(mod, "act_bits", 8) == 16 else "dynamic"),
                    w_scale=f"{float(mod.weight_scale.min()):.3g}..{float(mod.weight_scale.max()):.3g}",
                    out_scale=out_scale,
                    note=rec.note,
                )
            )
    else:
        for chain in state.chains:
            rows.append(
                dict(
                    name=chain.name,
                    pattern=_pattern(state, model, chain.name, chain.pattern),
                    precision="float (observing)",
                    kernel="",
                    input="",
                    output="",
                    note="",
                )
            )
    for skip in state.skipped:
        rows.append(
            dict(
                name=skip.name,
                pattern=skip.kind if skip.kind[:1].isupper() else skip.kind.capitalize(),
                precision="float",
                kernel="aten (not quantized)",
                input="",
                output="",
                note=skip.reason,
            )
        )
    return Summary(rows)
