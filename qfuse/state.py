"""What prepare and convert record on the graph module they return (read by summary and save)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qfuse.config import QConfig
from qfuse.fusion.patterns import Chain, Skipped

STATE_KEY = "qfuse_state"


@dataclass
class LayerRecord:
    """One fused layer of a converted model."""

    name: str
    pattern: str
    kind: str
    precision: str  # "int8"
    input: str  # "float (quantized in prologue)" | "int8 from <layer>"
    output: str  # "float32" | "int8 to <layer>, ..."
    note: str = ""


@dataclass
class QFuseState:
    config: QConfig
    stage: str  # "prepared" | "converted"
    chains: list[Chain]
    skipped: list[Skipped]
    observers: dict[str, str] = field(default_factory=dict)  # chain input node -> observer module
    layers: list[LayerRecord] = field(default_factory=list)
    folded_batchnorms: list[str] = field(default_factory=list)
    smoothquant: object | None = None  # qfuse.algorithms.smoothquant.SmoothQuant when enabled
    smoothed: list[str] = field(default_factory=list)  # chain names SmoothQuant applies to
    gptq: object | None = None  # qfuse.algorithms.gptq.GPTQ when enabled
    awq: object | None = None  # qfuse.algorithms.awq.AWQ when enabled
    awq_layers: list[str] = field(default_factory=list)  # chain names AWQ applies to
    hessians: dict[str, str] = field(default_factory=dict)  # chain name -> InputHessian module
    samples: dict[str, str] = field(default_factory=dict)  # chain input -> InputSamples module
    # Objects with ``apply(plan)`` that convert runs on its per-layer plan after SmoothQuant and
    # GPTQ (QAT's learned scales: qfuse.flows.qat.lower).
    plan_transforms: list = field(default_factory=list)
    qat: object | None = None  # qfuse.flows.qat.prepare.QATRecord on a model from qfuse.prepare_qat
    merged: list[list[str]] = field(default_factory=list)  # sibling Linears merged (members)
    source: object | None = None  # qfuse.validate.ModelRef: the user's model (output="model")
    pipeline: object | None = None  # qfuse.pipeline.PipelineOptions the graph passes ran with
    passes: dict[str, list] = field(default_factory=dict)  # pass name -> its record (pipeline)
    layer_configs: dict = field(default_factory=dict)  # prepare's per-layer QConfig globs


def get_state(model) -> QFuseState | None:
    """The qfuse record of a prepared/converted graph module, or None.

    Kept in ``GraphModule.meta``, which (unlike plain attributes) survives ``copy.deepcopy``; on
    any other module (``convert(output="model")``) in a plain attribute, which does.
    """
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict) and STATE_KEY in meta:
        return meta[STATE_KEY]
    return getattr(model, "__dict__", {}).get(STATE_KEY)


def set_state(model, state: QFuseState) -> None:
    if isinstance(getattr(model, "meta", None), dict):
        model.meta[STATE_KEY] = state
    else:
        model.__dict__[STATE_KEY] = state
