"""Start QAT from a calibrated PTQ model: its activation scales, observers and SmoothQuant factors.

convert's per-layer plan is the one definition of what SmoothQuant does to each layer (factors,
folded into the producer or applied in the prologue) and of each layer's input qparams; QAT reads
that plan off the PTQ model and bakes it into the QAT model's weights and fake quants.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from qfuse.errors import QFuseError
from qfuse.flows.plan import LayerPlan
from qfuse.fusion.patterns import Chain
from qfuse.observers import MinMaxObserver
from qfuse.state import get_state


@dataclass
class Carry:
    """What one layer takes over from PTQ."""

    x_qparams: tuple[torch.Tensor, torch.Tensor]
    observer: object  # the observer QAT continues from
    smoothing: torch.Tensor | None  # SmoothQuant factors applied in the prologue (else None)
    weight: torch.Tensor | None  # float weight after SmoothQuant (Linear layers)
    bias: torch.Tensor | None


def _seeded_minmax(observer, s: torch.Tensor, symmetric: bool) -> MinMaxObserver:
    """A per-tensor MinMax holding the range of ``x / s`` (SmoothQuant's smoothed input)."""
    lo, hi = observer.value_range()
    seeded = MinMaxObserver(symmetric=symmetric, layer_name=observer.layer_name)
    seeded.min_val, seeded.max_val = (lo / s).min(), (hi / s).max()
    seeded.num_batches.fill_(int(observer.num_batches))
    return seeded


def carry_over(ptq, chains: list[Chain], config, options=None) -> dict[str, Carry]:
    """Per QAT chain name, what to start from (``ptq`` is a calibrated ``qfuse.prepare`` model;
    ``options``: the QAT model's ``PipelineOptions``, whose merges the PTQ model must share)."""
    state = get_state(ptq)
    if state is None or state.stage != "prepared":
        raise QFuseError(
            "prepare_qat(from_prepared=...) takes a calibrated model returned by qfuse.prepare; "
            f"got {type(ptq).__name__}" + (f" at stage '{state.stage}'." if state else ".")
        )
    theirs = state.pipeline
    if options is not None and theirs is not None:
        for merge in ("merge_gated", "merge_siblings"):
            if getattr(options, merge) != getattr(theirs, merge):
                raise QFuseError(
                    f"prepare_qat runs {merge}={getattr(options, merge)} but the from_prepared "
                    f"model was prepared with {merge}={getattr(theirs, merge)}; give both the "
                    "same merge_siblings (or PipelineOptions)."
                )
    names = {c.name for c in chains}
    ptq_chains = [c for c in state.chains if c.name in names]
    missing = sorted(names - {c.name for c in ptq_chains})
    if missing:
        raise QFuseError(
            f"the PTQ model has no layers {missing}: prepare it from the same float model "
            "(same architecture and example inputs, same merge_siblings) as the QAT model."
        )
    dtypes = {c.name: config.dtype for c in ptq_chains}
    # No Hessians: QAT learns the rounding GPTQ would choose.
    plan = LayerPlan(ptq, state, ptq_chains, state.observers, dtypes, {})
    fp8 = config.dtype == torch.float8_e4m3fn
    carried = {}
    for chain in ptq_chains:
        obs = ptq.get_submodule(state.observers[chain.input])
        symmetric = obs.symmetric or fp8
        s = plan.smoothing.get(chain.name)
        if s is not None or obs.channel_axis is not None:  # a per-channel (SmoothQuant) observer
            seeded = _seeded_minmax(obs, s if s is not None else torch.ones(()), symmetric)
        else:
            seeded = copy.deepcopy(obs)
        carried[chain.name] = Carry(
            x_qparams=plan.x_qparams[chain.name],
            observer=seeded,
            smoothing=s if chain.name in plan.prologue else None,
            weight=plan.weights[chain.name] if chain.kind == "linear" else None,
            bias=plan.biases[chain.name] if chain.kind == "linear" else None,
        )
    return carried
