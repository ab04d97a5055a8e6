"""How ``qfuse.convert`` converts a QAT model: through the PTQ path, with QAT's learned scales.

The trained tensors (weights, BatchNorm statistics, LayerNorm, ...) keep the float model's names,
so they load into a copy of the float architecture; ``qfuse.prepare`` of that copy (eval mode)
captures it, folds BatchNorm with the trained statistics (``fold_conv_bn``, the function the QAT
forward folds with in eval mode) and finds the same chains. Its observers are replaced by the
fake quants' frozen qparams, and a plan transform hands convert the learned weight scales and
SmoothQuant's prologue factors. The result is an ordinary converted model: same fused ops,
summary, save/load and export as PTQ.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

import torch
from torch import fx, nn

from qfuse.errors import GraphMismatchError, ModeError, QFuseError
from qfuse.flows.prepare import prepare_pipeline
from qfuse.flows.qat.modules import full_tensor
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.pipeline import CAPTURE, mismatches
from qfuse.primitives import SCALE_EPS, inverse
from qfuse.state import get_state


class FixedQParams(nn.Module):
    """An identity standing where PTQ's observer stands, answering with fixed qparams."""

    channel_axis = None

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, symmetric: bool) -> None:
        super().__init__()
        self.symmetric = symmetric
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("zero_point", zero_point.detach().clone())

    def forward(self, x):
        return x

    def calculate_qparams(self):
        return self.scale, self.zero_point


class LearnedScales:
    """Plan transform: per-layer input qparams, SmoothQuant prologue factors, weight scales."""

    def __init__(self, x_qparams: dict, smoothing: dict, weight_scales: dict) -> None:
        self.x_qparams, self.smoothing, self.weight_scales = x_qparams, smoothing, weight_scales

    def apply(self, plan) -> None:
        for name, qparams in self.x_qparams.items():
            if name in plan.weights:
                plan.x_qparams[name] = qparams
        for name, s in self.smoothing.items():
            if name in plan.weights:  # the weights already carry the factors (QAT baked them)
                plan.smoothing[name] = s
                plan.prologue[name] = (inverse(s) * inverse(plan.x_qparams[name][0])).float()
        for name, scale in self.weight_scales.items():
            if name in plan.weights:
                plan.weight_scales[name] = scale


def _learned_weight_scale(fq, out_channels: int) -> torch.Tensor:
    scale = full_tensor(fq.scale.detach()).float().reshape(-1)
    return scale.clamp(min=SCALE_EPS).expand(out_channels).clone()


def _check_replay(eval_records: dict, train_records: dict) -> None:
    """The eval-mode graph merged exactly what the train-mode graph did (else the chains differ
    because of the merge, and the error says so)."""
    for name, mine, theirs in mismatches(eval_records, train_records, CAPTURE):
        lost = [g for g in theirs if g not in mine]
        raise GraphMismatchError(
            f"pass {name}: QAT merged the layers {lost} into one layer in the train-mode graph, "
            "but the eval-mode graph convert captures cannot merge them (their outputs are read "
            "differently there). QAT trained the merged weight, so convert cannot rebuild them; "
            "prepare_qat with merge_siblings=False (or PipelineOptions("
            f"{name}=False)) trains them as separate layers."
        )


def lower(qat_model: fx.GraphModule, notes: Mapping[str, str] | None,
          keep_float: Mapping[str, str] | None = None):
    """A prepared (PTQ-stage) model carrying ``qat_model``'s trained tensors and scales, and the
    summary notes for convert. A layer in ``keep_float`` whose weight QAT trained with
    SmoothQuant's factors baked in (``W * s``) gets its float weight back (``/ s``): convert
    leaves it float, and nothing divides its input by ``s`` there."""
    state = get_state(qat_model)
    record = state.qat
    if qat_model.training:
        raise ModeError(
            "qfuse.convert got a QAT model still in train mode; call qat_model.eval() first "
            "(eval mode freezes observers and BatchNorm statistics, and is what convert folds)."
        )
    with warnings.catch_warnings():  # torch's pytree spec pickling warns on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        arch = copy.deepcopy(record.float_model)
    names = set(arch.state_dict())
    qat_tensors = {k: full_tensor(v) for k, v in qat_model.state_dict().items()}
    arch.load_state_dict({k: v for k, v in qat_tensors.items() if k in names}, strict=False)
    prepared = prepare_pipeline(  # the QAT model's pipeline, its merges replayed exactly
        arch.eval(),
        state.config,
        record.example_inputs,
        record.example_kwargs,
        record.dynamic_shapes,
        record.pipeline,
        replay=record.passes,
        layer_configs=record.layer_configs,
    )
    pstate = get_state(prepared)
    _check_replay(pstate.passes, record.passes)
    with torch.no_grad():  # tensors prepare made, which QAT trained too (merged Q/K/V weights)
        for name, tensor in prepared.state_dict().items():
            if name not in names and name in qat_tensors:
                tensor.copy_(qat_tensors[name])
    mismatch = {c.name for c in pstate.chains} ^ set(record.act_fq)
    if mismatch:
        raise QFuseError(
            f"layers {sorted(mismatch)} exist only in the train-mode or only in the eval-mode "
            "graph of the model (code under `if self.training`?); QAT cannot convert them."
        )
    fp8 = state.config.dtype == torch.float8_e4m3fn
    # The QAT model may have trained on a GPU; convert builds on the float model's device.
    dev = next(iter(arch.parameters()), torch.empty(0)).device
    here = lambda pair: tuple(t.to(dev) for t in pair)  # noqa: E731
    for source, obs_name in pstate.observers.items():
        reader = next(c for c in pstate.chains if c.input == source)
        fq = qat_model.get_submodule(record.act_fq[reader.name])
        if fq.dynamic:  # no scale: the converted layer quantizes per token
            fixed = FixedQParams(torch.ones(()), torch.zeros((), dtype=torch.int32), True)
        else:
            fixed = FixedQParams(*here(fq.calculate_qparams()), fq.symmetric or fp8)
        prepared.set_submodule(obs_name, fixed)
    x_qparams, smoothing, weight_scales = {}, {}, {}
    for name in record.prologue:
        fq = qat_model.get_submodule(record.act_fq[name])
        if keep_float and name in keep_float:
            chain = next(c for c in pstate.chains if c.name == name)
            with torch.no_grad():
                attr_tensor(prepared, chain.weight).div_(fq.smoothing.to(dev))
            continue
        x_qparams[name], smoothing[name] = here(fq.calculate_qparams()), fq.smoothing.to(dev)
    for name, path in record.weight_fq.items():
        wfq = qat_model.get_submodule(path)
        if wfq.learnable:
            chain = next(c for c in pstate.chains if c.name == name)
            out_channels = attr_tensor(prepared, chain.weight).shape[0]
            weight_scales[name] = _learned_weight_scale(wfq, out_channels).to(dev)
    pstate.plan_transforms = [LearnedScales(x_qparams, smoothing, weight_scales)]
    prepared.requires_grad_(False)
    merged = {}
    for chain in pstate.chains:
        parts = ["QAT" + (" (LSQ scales)" if record.qat.learnable_scales else "")]
        if chain.name in smoothing:
            parts.append("SmoothQuant from PTQ (prologue)")
        if notes and chain.name in notes:
            parts.append(notes[chain.name])
        merged[chain.name] = "; ".join(parts)
    return prepared, merged
