"""The per-layer plan convert builds fused modules from, and the algorithms that transform it.

``LayerPlan`` starts from what calibration gives: each chain's float weight and bias and its
input qparams from its observer. Algorithms are transforms (``apply(plan)``) run in order over
it: SmoothQuant (factors from the observers, folded into the producer or kept as a prologue
vector), GPTQ (rounds the weights that ship, against the plain per-channel scale), and those the
state carries (QAT's learned scales: ``qfuse.qat.lower``). convert, the module swap and QAT's
PTQ carry-over read the same plan.
"""

from __future__ import annotations

import torch

from qfuse.config import PerChannel
from qfuse.fusion.graph_utils import attr_tensor
from qfuse.fusion.patterns import Chain
from qfuse.gptq import round_layer
from qfuse.primitives import choose_qparams, inverse, weight_scale
from qfuse.progress import progress
from qfuse.smoothquant import factors, smoothed_qparams


def _tensor(gm, target: str | None) -> torch.Tensor | None:
    return attr_tensor(gm, target).detach() if target is not None else None


def _per_tensor_qparams(observer, symmetric: bool):
    """Per-tensor qparams, also from a per-channel (SmoothQuant) observer, and symmetric ones
    from an affine observer when the layer needs them (fp8 is symmetric only)."""
    qparams = observer.calculate_qparams()  # the checks (calibrated, not all-zero) and messages
    if observer.channel_axis is None and symmetric == observer.symmetric:
        return qparams
    lo, hi = observer.value_range()
    return choose_qparams(lo.min(), hi.max(), symmetric=symmetric)


class LayerPlan:
    """Float weights, input qparams, prologue vectors, SmoothQuant factors and weight scales per
    chain, after every transform."""

    def __init__(self, gm, state, chains, observers, dtypes, hessians):
        self.chains = list(chains)
        self.dtypes = dtypes  # chain name -> torch.int8 | torch.float8_e4m3fn
        self.weights = {c.name: _tensor(gm, c.weight).float() for c in chains}
        self.biases = {c.name: _tensor(gm, c.bias) for c in chains}
        self.biases = {k: (b.float() if b is not None else None) for k, b in self.biases.items()}
        # chain input node -> its observer module (SmoothQuant reads their per-channel ranges)
        self.observers = {src: gm.get_submodule(name) for src, name in observers.items()}
        self.x_qparams = {
            c.name: _per_tensor_qparams(self.observers[c.input], self.symmetric_input(c))
            for c in chains
        }
        self.prologue = {}  # chain name -> per-input-channel inverse-scale vector
        self.smoothing = {}  # chain name -> SmoothQuant factors s (the layer sees x / s)
        self.weight_scales = {}  # chain name -> the scale the weight was rounded against
        for transform in transforms(state, hessians):
            transform.apply(self)

    def symmetric_input(self, chain: Chain) -> bool:
        """Whether the chain's input is quantized symmetrically (its observer's scheme; fp8)."""
        fp8 = self.dtypes[chain.name] == torch.float8_e4m3fn
        return self.observers[chain.input].symmetric or fp8


class SmoothQuantTransform:
    """SmoothQuant over the layers ``qfuse.prepare`` selected: each gets factors ``s`` from its
    per-channel input range; ``x / s`` is folded into a producer Linear that only it reads,
    otherwise applied in the layer's prologue."""

    def __init__(self, smoothquant, smoothed: list[str]) -> None:
        self.smoothquant, self.smoothed = smoothquant, smoothed

    def apply(self, plan: LayerPlan) -> None:
        by_name = {c.name: c for c in plan.chains}
        readers: dict[str, list[Chain]] = {}
        for c in plan.chains:
            readers.setdefault(c.input, []).append(c)
        for name in self.smoothed:
            chain = by_name.get(name)
            if chain is None:  # kept float, or not swapped
                continue
            lo, hi = plan.observers[chain.input].value_range()
            s = factors(
                torch.maximum(lo.abs(), hi.abs()), plan.weights[name], self.smoothquant.alpha
            )
            plan.weights[name] = plan.weights[name] * s[None, :]
            plan.smoothing[name] = s
            plan.x_qparams[name] = smoothed_qparams(lo, hi, s, plan.symmetric_input(chain))
            producer = next((c for c in plan.chains if c.output == chain.input), None)
            if producer is not None and len(producer.nodes) == 1 and len(readers[chain.input]) == 1:
                plan.weights[producer.name] = plan.weights[producer.name] / s[:, None]
                if plan.biases[producer.name] is not None:
                    plan.biases[producer.name] = plan.biases[producer.name] / s
            else:
                plan.prologue[name] = (inverse(s) * inverse(plan.x_qparams[name][0])).float()


class GPTQTransform:
    """GPTQ rounding of the layers with a recorded input Hessian, after SmoothQuant (it rounds
    the weights that ship), against the plain per-channel (or per-tensor) scale."""

    def __init__(self, gptq, hessians: dict, per_channel: bool) -> None:
        self.gptq, self.hessians, self.per_channel = gptq, hessians, per_channel

    def apply(self, plan: LayerPlan) -> None:
        for c in progress([c for c in plan.chains if c.name in self.hessians], "GPTQ rounding"):
            dtype = plan.dtypes[c.name]
            scale = weight_scale(plan.weights[c.name], dtype, self.per_channel)
            plan.weights[c.name] = round_layer(
                self.hessians[c.name],
                c.name,
                plan.weights[c.name],
                scale,
                dtype,
                self.gptq,
                plan.smoothing.get(c.name),
            )
            plan.weight_scales[c.name] = scale


def transforms(state, hessians: dict) -> list:
    """The transforms of a prepared model's plan, in order: SmoothQuant, GPTQ (for the layers
    in ``hessians``: chain name -> InputHessian), then the state's own (QAT's learned scales)."""
    out = []
    if state.smoothquant is not None and state.smoothed:
        out.append(SmoothQuantTransform(state.smoothquant, state.smoothed))
    if hessians:
        per_channel = isinstance(state.config.weight_granularity, PerChannel)
        out.append(GPTQTransform(state.gptq, hessians, per_channel))
    return out + list(state.plan_transforms)
